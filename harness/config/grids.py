"""Experiment grids as data: ``protocols/grids/<name>.toml`` parsed, validated and
expanded into cells (one run each).

A grid names a protocol and the axes ``methods x losses x backbones x datasets x
seeds``; ``methods = "all"`` is every registered method that is not an ablation (the
``--methods all`` list, installed plugins included) less the names in ``exclude``;
``[[extra]]`` tables add sub-grids that override some axes (e.g. the SOP
row of a paper's table), ``[backbone.<name>] set = {...}`` holds the settings a paper
prescribes for one backbone (the grid's protocol *variant*: fingerprinted, not a
deviation), top-level ``set`` and ``[smoke] set`` are protocol overrides recorded as
deviations. ``[smoke]`` replaces any top-level key for the tiny version (``--smoke``).
``[test_time] method = "base"`` makes ``method`` a test-time-only method (DIML): its
cell trains nothing and evaluates the selected weights of the ``base`` cell with the
same backbone, loss, dataset and seed, under the same protocol (so both land in one
comparison). ``metrics`` names the table's metric columns. ``[published] rows`` maps a
reproduced method to the published rows it sits beside, as ``"method@setting"`` (the
CSV's ``method`` and ``setting`` columns; DIABLO Table 1 prints binomial + DIABLO with
N = 8 and N = 16): ``diablo_n16 = ["diablo@entries=16"]``; with it, published rows
no entry names are left out of the tables. ``[published] metrics`` maps a published
metric to the reproduced variant that the paper's definition matches (DIML:
``r_precision = "r_precision_query_in_r"``). ``baseline`` names the method every other
row of a block is tested against in the tables (default ``plain``). A ``datasets`` entry
is a built-in dataset's name or your own dataset's path, relative to the grid file (a
folder of class folders or a CSV: :mod:`harness.components.data.own`). Unknown keys are
errors naming the key. ``[executor.slurm]`` holds the resources each task of ``sweep
--executor slurm`` asks for (:mod:`harness.config.executor`); it enters no cell key.

Each :class:`Cell` has a ``key``: a hash of everything that determines its result
(resolved protocol, dataset, loss and its arguments, method and options, seed,
deviations; for a dataset given by its path, the fingerprint of its file list),
computed without reading an image, so a sweep can find finished cells in the tracking
store.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from harness.base.errors import HarnessError, unknown_name
from harness.base.paths import read_text
from harness.config.deviations import PaperDeviation, applicable
from harness.config.executor import check_time
from harness.config.grid_file import GridFile, grid_json_schema
from harness.config.overrides import Deviation, flatten_keys
from harness.config.protocol import Protocol, apply_overrides
from harness.config.protocol_files import load_protocol, protocol_dir
from harness.config.schema import refusal, shown
from harness.config.tuning import TuneSpec, parse_tune

__all__ = [
    "Grid",
    "Cell",
    "GridFile",
    "grid_json_schema",
    "load_grid",
    "list_grids",
    "grid_dir",
    "expand",
    "MAX_CELLS",
    "cell_count",
]

AXES = ("methods", "losses", "backbones", "datasets", "seeds")


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


def grid_dir() -> Path:
    return protocol_dir() / "grids"


def list_grids() -> list[str]:
    return sorted(p.stem for p in grid_dir().glob("*.toml"))


#: A grid's name: it names the sweep's folder (``sweeps/<name>``), its queue's study and
#: its experiment, so it is one plain file name.
GRID_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: The most cells a grid expands to unless its sweep is given ``--yes``: a larger one is
#: most likely an axis written by mistake (each cell is a training run).
MAX_CELLS = 5_000


def cell_count(axes: dict[str, list], extras: list[dict[str, list]]) -> int:
    """The cells the axes and ``[[extra]]`` tables span, before duplicates are merged."""

    def span(sub: dict[str, list]) -> int:
        return math.prod(len(sub[a]) for a in AXES)

    return span(axes) + sum(span({**axes, **extra}) for extra in extras)


def _protocol_slurm(protocol: str) -> dict[str, Any]:
    """The ``[executor.slurm]`` table of the grid's protocol (its set keys)."""
    slurm = load_protocol(protocol).executor.slurm.model_dump(exclude_none=True)
    if "time" in slurm:
        check_time(slurm["time"], f"protocol key 'executor.slurm.time' = {shown(slurm['time'])}")
    return slurm


def load_grid(
    name_or_path: str | Path,
    *,
    smoke: bool = False,
    max_cells: int | None = MAX_CELLS,
    on_count: Callable[[int], object] | None = None,
) -> Grid:
    """Parse and validate a grid (a name under ``protocols/grids`` or a ``.toml`` path),
    then expand it into cells (``grid.cells``). ``on_count(n)`` hears the number of cells
    before they are expanded; more than ``max_cells`` (None: no cap) is refused."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = grid_dir() / f"{name_or_path}.toml"
        if not path.is_file():
            raise unknown_name("grid", str(name_or_path), list_grids())
    if not path.is_file():
        raise HarnessError(f"grid file not found: {path}")
    try:
        data = tomllib.loads(read_text(path, "TOML"))
    except tomllib.TOMLDecodeError as err:
        raise HarnessError(f"malformed grid file {path}: {err}") from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise HarnessError(f"malformed grid file {path}: nested too deeply") from None
    try:
        spec = GridFile.model_validate(data)
    except ValidationError as err:
        raise refusal(err, GridFile.model_json_schema(), what="grid key") from None
    slurm_defaults = spec.executor.slurm.model_dump(exclude_none=True)
    if "time" in slurm_defaults:
        check_time(
            slurm_defaults["time"],
            f"grid key 'executor.slurm.time' = {shown(slurm_defaults['time'])}",
        )
    data = _with_dataset_names(_with_method_names(data, path), path)
    smoke_data = data.get("smoke", {})
    if smoke and not smoke_data:
        raise HarnessError(f"grid {path.stem} has no [smoke] table; --smoke needs one")
    top = {**data, **smoke_data} if smoke else data
    if smoke and "set" in smoke_data:  # smoke's overrides come on top of the grid's own
        top["set"] = {**data.get("set", {}), **smoke_data["set"]}
    axes = {a: list(top[a]) for a in AXES}
    extras = []
    for extra in data.get("extra", []):
        sub = {a: list(v) for a, v in extra.items()}
        if smoke:  # the smoke version replaces these axes everywhere
            sub.update({a: axes[a] for a in AXES if a in smoke_data})
        extras.append(sub)
    published = data.get("published", {})
    all_methods = {m for sub in (data, *data.get("extra", [])) for m in sub.get("methods", [])}
    published_rows = _published_rows(published.get("rows", {}), all_methods)
    variants = {
        backbone: dict(spec.get("set", {})) for backbone, spec in data.get("backbone", {}).items()
    }
    test_time = data.get("test_time", {})
    metrics = list(data.get("metrics", []))
    baseline = data.get("baseline", "plain")
    if "baseline" in data and baseline not in all_methods:
        raise HarnessError(
            f"grid key 'baseline' = \"{baseline}\": expected a method of the grid (methods: "
            f"{', '.join(sorted(all_methods))})"
        )
    published_metrics = published.get("metrics", {})

    def resolved(protocol: str) -> str:
        if protocol.endswith(".toml") and not Path(protocol).is_absolute():
            return str((path.parent / protocol).resolve())
        return protocol

    protocol = resolved(str(top["protocol"]))
    tune = _tune_spec(
        data, smoke, protocol, dict(top.get("set", {})), all_methods, axes, extras, test_time
    )
    name = str(data.get("name", path.stem))
    if not GRID_NAME.fullmatch(name):
        raise HarnessError(
            f"grid key 'name' = {shown(name)}: expected a name of letters, digits, '.', '_' "
            f"and '-' that starts with a letter or digit (it names the sweep's folder under "
            f"sweeps/, its study and its experiment)"
            if "name" in data
            else f"grid file {path}: its name {name!r} cannot name a sweep; expected a file "
            f"name of letters, digits, '.', '_' and '-' (or a 'name' key)"
        )
    slurm_defaults = {**_protocol_slurm(protocol), **slurm_defaults}  # the grid's own win
    grid = Grid(
        name=name + ("-smoke" if smoke else ""),
        path=path,
        description=str(data.get("description", "")),
        protocol=protocol,
        experiment=str(top.get("experiment") or (name + ("-smoke" if smoke else ""))),
        axes=axes,
        extras=tuple(extras),
        overrides=dict(top.get("set", {})),
        variants=variants,
        published_file=str(published.get("file", "")),
        published_tables=tuple(str(t) for t in published.get("tables", ())),
        published_rows=published_rows,
        smoke=smoke,
        test_time=dict(test_time),
        metrics=tuple(metrics),
        baseline=baseline,
        published_metrics=dict(published_metrics),
        paper_protocol=resolved(str(data["protocol"])),
        paper_axes={a: _with_extras(data, a) for a in ("datasets", "backbones")},
        slurm=slurm_defaults,
        tune=tune,
    )
    count = cell_count(axes, extras)
    if on_count is not None:
        on_count(count)
    if max_cells is not None and count > max_cells:
        raise HarnessError(
            f"grid {path.stem} has {count:,} cells, more than {max_cells:,} (each a training run); "
            f"check its axes, or give --yes to sweep them all"
        )
    grid.cells.extend(expand(grid))
    return grid


def _tune_spec(
    data: dict[str, Any],
    smoke: bool,
    protocol: str,
    overrides: dict[str, Any],
    methods: set[str],
    axes: dict[str, list],
    extras: list[dict[str, list]],
    test_time: dict[str, str],
) -> TuneSpec | None:
    """The grid's ``[tune]`` table (``[smoke.tune]``'s keys on top for the smoke version),
    validated against the protocol, the grid's methods and losses."""
    if "tune" not in data:
        if smoke and data.get("smoke", {}).get("tune"):
            raise HarnessError("grid key 'smoke.tune' needs a [tune] table in the grid")
        return None
    table = dict(data["tune"])
    if smoke:
        table.update(data.get("smoke", {}).get("tune", {}))
    losses = sorted({loss for sub in (axes, *extras) for loss in sub.get("losses", axes["losses"])})
    resolved, _ = apply_overrides(load_protocol(protocol), overrides)
    spec = parse_tune(table, resolved, sorted(methods), losses)
    for name in spec.space:
        head, _, rest = name.partition(".")
        if head == "method" and rest.split(".")[0] in test_time:
            raise HarnessError(
                f"grid key 'tune.space.\"{name}\"': '{rest.split('.')[0]}' is a test-time method "
                f"(test_time), evaluated on its base's tuned weights with the protocol's options; "
                f"its options cannot be searched apart from its base"
            )
    return spec


def _with_method_names(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` with each ``methods = "all"`` (top level, ``[[extra]]``, ``[smoke]``) replaced
    by the names it stands for; ``exclude`` must name registered methods."""
    from harness.methods import METHODS, list_methods

    tables = [data, *data.get("extra", []), data.get("smoke", {})]
    exclude = data.get("exclude", [])
    if exclude and not any(table.get("methods") == "all" for table in tables):
        raise HarnessError(
            f"grid {path.stem}: 'exclude' applies to methods = \"all\", which the grid does not use"
        )
    for name in exclude:
        if name not in METHODS:
            raise HarnessError(
                f"grid {path.stem}: exclude names '{name}', which is not a registered method"
            )
    every = [name for name in list_methods(ablations=False) if name not in exclude]
    if not every:
        raise HarnessError(f'grid {path.stem}: methods = "all" less exclude leaves no method')

    def named(table: dict[str, Any]) -> dict[str, Any]:
        return {**table, "methods": every} if table.get("methods") == "all" else table

    out = named(data)
    if "extra" in data:
        out["extra"] = [named(extra) for extra in data["extra"]]
    if "smoke" in data:
        out["smoke"] = named(data["smoke"])
    return out


def _with_dataset_names(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` with each ``datasets`` entry (top level, ``[[extra]]``, ``[smoke]``) that is
    a path, relative to the grid's folder, replaced by the name it is registered under
    (:func:`~harness.components.data.own.dataset_name`); two paths that would share a name
    are an error."""
    from harness.components.data.own import dataset_manifest, dataset_name

    names: dict[str, str] = {}  # entry -> name
    sources: dict[str, str] = {}  # name -> the folder or file it stands for

    def name_of(entry: str) -> str:
        if entry not in names:
            try:
                names[entry] = dataset_name(entry, base=path.parent)
            except HarnessError as err:
                raise HarnessError(f"grid {path.stem}, datasets: {err}") from None
            files = dataset_manifest(names[entry])
            if files is not None and sources.setdefault(names[entry], files.source) != files.source:
                raise HarnessError(
                    f"grid {path.stem}: datasets {sources[names[entry]]} and {files.source} would "
                    f"both be named '{names[entry]}'; rename one of them"
                )
        return names[entry]

    def named(table: dict[str, Any]) -> dict[str, Any]:
        if "datasets" not in table:
            return table
        return {**table, "datasets": [name_of(entry) for entry in table["datasets"]]}

    out = named(data)
    if "extra" in data:
        out["extra"] = [named(extra) for extra in data["extra"]]
    if "smoke" in data:
        out["smoke"] = named(data["smoke"])
    return out


def _with_extras(data: dict[str, Any], axis: str) -> list[str]:
    """The grid file's values of ``axis``, its ``[[extra]]`` sub-grids' included (Table 4's
    SOP row of agrouping-table3 is a paper dataset too)."""
    return list(
        dict.fromkeys(
            [*data[axis], *(v for extra in data.get("extra", []) for v in extra.get(axis, []))]
        )
    )


def _published_rows(rows: dict[str, list[str]], methods: set[str]) -> dict[str, tuple[str, ...]]:
    """``[published] rows``: each key a method of the grid (a misspelt one would silently
    drop its published values)."""
    for method in rows:
        if method not in methods:
            raise HarnessError(
                f"grid key 'published.rows.{method}': '{method}' is not a method of the grid "
                f"(methods: {', '.join(sorted(methods))})"
            )
    return {method: tuple(specs) for method, specs in rows.items()}


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
    from harness.components.data.own import dataset_manifest
    from harness.methods import METHODS

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


def expand(grid: Grid) -> list[Cell]:
    """All cells of the grid, main axes then extras, without duplicates; names are checked
    against the registries (methods, losses, datasets, backbones) before anything runs.
    A test-time-only cell comes after its base cell and carries the base cell's key."""
    from harness.components.backbones import BACKBONES
    from harness.components.data import DATASETS
    from harness.components.losses import LOSSES
    from harness.methods import METHODS, training_base

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
                LOSSES.get(loss)
                if loss != variant_protocol.loss.name and loss not in variant_protocol.loss.args:
                    raise HarnessError(
                        f"grid {grid.name}: loss '{loss}' has no arguments in protocol "
                        f"'{variant_protocol.name}' ([loss.args.{loss}]); add them there"
                    )
                for dataset in sub["datasets"]:
                    DATASETS.get(dataset)
                    # The protocol's settings for this dataset, then the grid's deviations.
                    protocol, deviations = apply_overrides(
                        variant_protocol.for_dataset(dataset), grid.overrides
                    )
                    loss_args = protocol.loss_args(loss)
                    keys: dict[tuple[str, int], str] = {}
                    # Base methods first, so that every test-time cell finds its base's key.
                    for method in sorted(sub["methods"], key=lambda m: m in grid.test_time):
                        METHODS.get(method)
                        base_method = grid.test_time.get(method, "")
                        if base_method and (
                            base_method not in sub["methods"] or base_method in grid.test_time
                        ):
                            raise HarnessError(
                                f"grid {grid.name}: test_time.{method} = '{base_method}' must name a trained "
                                f"method of the same grid (methods there: {', '.join(sub['methods'])})"
                            )
                        if base_method and training_base(method, protocol.methods) != base_method:
                            raise HarnessError(
                                f"grid {grid.name}: test_time.{method} = '{base_method}', but with the options of "
                                f"protocol '{protocol.name}' {method} does not train as {base_method}; its cells "
                                f"would evaluate weights trained another way (expected a method whose "
                                f"Method.trains_as names '{base_method}' with the protocol's options for it)"
                            )
                        options = dict(protocol.methods.get(method, {}))
                        key_of = functools.partial(
                            _cell_key, protocol, dataset, loss, loss_args, method, options
                        )
                        # What a tuned grid's study shares: every field but the seed.
                        study_key = key_of(-1, deviations, "", grid.tune)
                        for seed in sub["seeds"]:
                            base_key = keys[(base_method, seed)] if base_method else ""
                            key = key_of(seed, deviations, base_key, grid.tune)
                            keys[(method, seed)] = key
                            cells.setdefault(
                                key,
                                Cell(
                                    grid=grid.name,
                                    backbone=backbone,
                                    loss=loss,
                                    method=method,
                                    dataset=dataset,
                                    seed=seed,
                                    protocol=protocol,
                                    protocol_path=path,
                                    loss_args=loss_args,
                                    method_options=options,
                                    variant=variant,
                                    deviations=deviations,
                                    key=key,
                                    base_key=base_key,
                                    paper_deviations=cell_deviations(
                                        grid, protocol, method, dataset, backbone, loss
                                    ),
                                    study_key=study_key,
                                ),
                            )
    return list(cells.values())
