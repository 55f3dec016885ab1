"""A grid as loaded (:class:`Grid`) and its cells (:class:`Cell`, one run each): the
expansion of its axes into cells, each cell's key and its departures from the paper.

A cell's ``key`` hashes everything that determines its result (resolved protocol, dataset,
loss and its arguments, method and options, seed, deviations; for a dataset given by its
path, the fingerprint of its file list), computed without reading an image, so a sweep can
find finished cells in the tracking store. Parsing a grid file is
:mod:`harness.config.grids`'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError
from harness.components.backbones import BACKBONES
from harness.components.data import DATASETS
from harness.components.data.own import dataset_manifest
from harness.components.losses import LOSSES
from harness.config.catalog import protocol_dir
from harness.config.deviations import PaperDeviation, applicable
from harness.config.overrides import Deviation, flatten_keys
from harness.config.protocol import Protocol, apply_overrides
from harness.config.protocol_files import load_protocol
from harness.config.tuning import TuneSpec
from harness.methods import METHODS, training_base

__all__ = ["Grid", "Cell", "expand", "cell_deviations", "SMOKE_WHY"]


@dataclass(frozen=True)
class Cell:
    """One run of a grid: (backbone, loss, method, dataset, seed) under a resolved protocol."""

    grid: str
    backbone: str
    loss: str
    method: str
    dataset: str
    seed: int
    protocol: Protocol
    protocol_path: Path | None
    loss_args: dict[str, Any]
    method_options: dict[str, Any]
    #: Settings of the grid's variant for this backbone (not deviations).
    variant: dict[str, Any]
    deviations: tuple[Deviation, ...]
    key: str
    #: Key of the cell whose selected weights this test-time-only cell evaluates ("" if it trains).
    base_key: str = ""
    #: Where this cell departs from the paper or the authors' code: its paper protocol's
    #: declared ``[deviations]``, and for a smoke cell every setting the smoke version
    #: changes (recorded with the run and printed under its tables; not in the key).
    paper_deviations: dict[str, PaperDeviation] = field(default_factory=dict, compare=False)
    #: The key of everything but the seed: the cells of one tuned grid's study share it.
    study_key: str = ""

    @property
    def label(self) -> str:
        return f"{self.backbone}/{self.loss}/{self.method}/{self.dataset}/seed{self.seed}"


@dataclass(frozen=True)
class Grid:
    name: str
    path: Path
    description: str
    protocol: str
    experiment: str
    axes: dict[str, list]
    extras: tuple[dict[str, list], ...]
    #: Protocol overrides recorded as deviations (top-level or ``[smoke] set``).
    overrides: dict[str, Any]
    #: ``{backbone: {dotted key: value}}`` prescribed by the paper (not deviations).
    variants: dict[str, dict[str, Any]]
    published_file: str = ""
    published_tables: tuple[str, ...] = ()
    #: ``{reproduced method: ("method@setting", ...)}``: the published rows beside each
    #: method (empty: every published row, by its own method name).
    published_rows: dict[str, tuple[str, ...]] = field(default_factory=dict)
    smoke: bool = False
    #: ``{method: base method}``: methods applied at test time to the base method's weights.
    test_time: dict[str, str] = field(default_factory=dict)
    #: Metric columns of the grid's tables (empty: the published table's, else the default).
    metrics: tuple[str, ...] = ()
    #: The method of each block's reference row in the tables' paired tests.
    baseline: str = "plain"
    #: ``{published metric: reproduced metric}`` where the paper defines a metric differently.
    published_metrics: dict[str, str] = field(default_factory=dict)
    cells: list[Cell] = field(default_factory=list, compare=False, repr=False)
    #: The grid's own protocol (its smoke version may run another): the paper's setting.
    paper_protocol: str = ""
    #: The grid's own datasets and backbones, against which a smoke version's are deviations.
    paper_axes: dict[str, list] = field(default_factory=dict, compare=False, repr=False)
    #: The keys the grid's ``[executor.slurm]`` sets: defaults of ``sweep --executor slurm``.
    slurm: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: ``[tune]`` (with ``[smoke.tune]`` on top for the smoke version): every method tuned
    #: with the same budget before the final runs (None: cells run as the protocol sets them).
    tune: TuneSpec | None = None


def expand(grid: Grid) -> list[Cell]:
    """All cells of the grid, main axes then extras, without duplicates; names are checked
    against the registries (methods, losses, datasets, backbones) before anything runs.
    A test-time-only cell comes after its base cell and carries the base cell's key."""
    # Imported here: the backbones (timm) would cost every command's start-up.

    base = load_protocol(grid.protocol)
    path = (
        Path(grid.protocol)
        if grid.protocol.endswith(".toml")
        else protocol_dir() / f"{grid.protocol}.toml"
    )
    cells: dict[str, Cell] = {}
    for sub in (grid.axes, *({**grid.axes, **e} for e in grid.extras)):
        for backbone in sub["backbones"]:
            BACKBONES.get(backbone)
            variant = {"backbone.name": backbone, **grid.variants.get(backbone, {})}
            variant_protocol, _ = apply_overrides(base, variant)
            for loss in sub["losses"]:
                _check_loss(grid, loss, variant_protocol)
                for dataset in sub["datasets"]:
                    DATASETS.get(dataset)
                    # The protocol's settings for this dataset, then the grid's deviations.
                    protocol, deviations = apply_overrides(
                        variant_protocol.for_dataset(dataset), grid.overrides
                    )
                    place = _Place(backbone, loss, dataset, variant, protocol, path, deviations)
                    for cell in _place_cells(grid, sub, place):
                        cells.setdefault(cell.key, cell)
    return list(cells.values())


@dataclass(frozen=True)
class _Place:
    """Where in the grid a block of cells sits: everything a cell has but its method and
    seed."""

    backbone: str
    loss: str
    dataset: str
    variant: dict[str, Any]
    protocol: Protocol
    protocol_path: Path
    deviations: tuple[Deviation, ...]


def _check_loss(grid: Grid, loss: str, protocol: Protocol) -> None:
    """A registered loss that the protocol has arguments for."""
    LOSSES.get(loss)
    if loss != protocol.loss.name and loss not in protocol.loss.args:
        raise HarnessError(
            f"grid {grid.name}: loss '{loss}' has no arguments in protocol "
            f"'{protocol.name}' ([loss.args.{loss}]); add them there"
        )


def _place_cells(grid: Grid, sub: dict[str, list], place: _Place) -> list[Cell]:
    """The cells of one place: each method of ``sub`` (base methods first, so that every
    test-time cell finds its base's key) with each seed."""
    protocol = place.protocol
    loss_args = protocol.loss_args(place.loss)
    keys: dict[tuple[str, int], str] = {}
    out = []
    for method in sorted(sub["methods"], key=lambda m: m in grid.test_time):
        METHODS.get(method)
        base_method = _test_time_base(grid, sub, protocol, method)
        options = dict(protocol.methods.get(method, {}))
        key_of = functools.partial(
            _cell_key, protocol, place.dataset, place.loss, loss_args, method, options
        )
        # What a tuned grid's study shares: every field but the seed.
        study_key = key_of(-1, place.deviations, "", grid.tune)
        for seed in sub["seeds"]:
            base_key = keys[(base_method, seed)] if base_method else ""
            key = key_of(seed, place.deviations, base_key, grid.tune)
            keys[(method, seed)] = key
            out.append(
                Cell(
                    grid=grid.name,
                    backbone=place.backbone,
                    loss=place.loss,
                    method=method,
                    dataset=place.dataset,
                    seed=seed,
                    protocol=protocol,
                    protocol_path=place.protocol_path,
                    loss_args=loss_args,
                    method_options=options,
                    variant=place.variant,
                    deviations=place.deviations,
                    key=key,
                    base_key=base_key,
                    paper_deviations=cell_deviations(
                        grid, protocol, method, place.dataset, place.backbone, place.loss
                    ),
                    study_key=study_key,
                )
            )
    return out


def _test_time_base(grid: Grid, sub: dict[str, list], protocol: Protocol, method: str) -> str:
    """The trained method whose weights ``method``'s cells evaluate ("" when it trains):
    a method of the same sub-grid that ``method`` trains as under the protocol's options."""
    base_method = grid.test_time.get(method, "")
    if base_method and (base_method not in sub["methods"] or base_method in grid.test_time):
        raise HarnessError(
            f"grid {grid.name}: test_time.{method} = '{base_method}' must name a trained "
            f"method of the same grid (methods there: {', '.join(sub['methods'])})"
        )
    if base_method and training_base(method, protocol.methods) != base_method:
        raise HarnessError(
            f"grid {grid.name}: test_time.{method} = '{base_method}', but with the options of "
            f"protocol '{protocol.name}' {method} does not train as {base_method}; its cells "
            f"would evaluate weights trained another way (expected a method whose "
            f"TrainsAsAnother.trains_as names '{base_method}' with the protocol's options for it)"
        )
    return base_method


def _cell_key(
    protocol: Protocol,
    dataset: str,
    loss: str,
    loss_args: dict,
    method: str,
    options: dict,
    seed: int,
    deviations: tuple[Deviation, ...],
    base_key: str = "",
    tune: TuneSpec | None = None,
) -> str:
    fields: dict[str, Any] = {
        "protocol": protocol.to_dict(),
        "dataset": dataset,
        "loss": loss,
        "loss_args": loss_args,
        "method": method,
        "options": options,
        "seed": seed,
        "deviations": [str(d) for d in deviations],
    }
    if base_key:  # only then, so that the keys of grids without test-time methods never change
        fields["base_key"] = base_key
    if tune is not None:  # a tuned cell: its budget and space decide its result too
        fields["tune"] = tune.canonical()

    files = dataset_manifest(dataset)
    if files is not None:  # a dataset given by its path: changed files make new cells
        fields["dataset_fingerprint"] = files.fingerprint

    fields.update(METHODS.get(method).key_fields())
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


SMOKE_WHY = (
    "The smoke version: a CPU-sized pipeline check, not comparable with the published numbers"
)


def cell_deviations(
    grid: Grid,
    protocol: Protocol,
    method: str,
    dataset: str,
    backbone: str,
    loss: str | None = None,
) -> dict[str, PaperDeviation]:
    """A cell's departures from its paper: the paper protocol's declared deviations that
    concern it, and for a smoke cell each setting, dataset or backbone the smoke version
    changes against the paper protocol (so that none goes unprinted)."""
    paper = load_protocol(grid.paper_protocol or grid.protocol)
    paper_dataset = (
        dataset
        if dataset in grid.paper_axes.get("datasets", [dataset])
        else grid.paper_axes["datasets"][0]
    )
    reference = paper.for_dataset(paper_dataset)
    found = applicable(reference.deviations, method, paper_dataset, backbone, loss)
    if not grid.smoke:
        return found
    changed = {}
    if dataset not in grid.paper_axes.get("datasets", [dataset]):
        changed["dataset"] = (", ".join(grid.paper_axes["datasets"]), dataset)
    if backbone not in grid.paper_axes.get("backbones", [backbone]):
        changed["backbone"] = (", ".join(grid.paper_axes["backbones"]), backbone)
    ours, theirs = flatten_keys(protocol.to_dict()), flatten_keys(reference.to_dict())
    for key in sorted(set(ours) | set(theirs)):
        if key not in ("name", "description", "source", "backbone.name") and ours.get(
            key
        ) != theirs.get(key):
            changed[key] = (theirs.get(key, "unset"), ours.get(key, "unset"))
    for key, (was, now) in changed.items():
        found["smoke_" + key.replace(".", "_")] = PaperDeviation(
            paper=f"{key} = {was}",
            harness=f"{key} = {now}",
            why=SMOKE_WHY,
            reference=f"protocol {reference.name}",
        )
    return found
