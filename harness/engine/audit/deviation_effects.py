"""The effect of what stays different: each deviation of a grid switched to the authors'
value against the grid's value, at the smoke scale (``python -m harness deviations
--grid G --measure``).

The authors' value of a deviation is what its recipe ledger's entries say
(:mod:`harness.config.ledger`): the entries that name the deviation and apply to the
paper's cell a smoke cell stands for (its method and loss on the paper's first dataset
and backbone) give the protocol keys to set. Each smoke cell the deviation changes is run
with those keys and without, over the same seeds; the paired differences of its test
P@1 and MAP@R (authors' minus grid's) are reported with their 95% t-intervals. A
deviation whose ledger lists it as ``[unmeasured]``, or that no entry sets on the smoke
cells, is reported with the reason instead. Runs are in-process and untracked (an
in-memory recorder: nothing is written to the tracking store); a test-time cell (DIML)
evaluates the weights its base cell trained under the same setting.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.base.errors import HarnessError
from harness.components.data import DatasetSplits
from harness.config.grids import Cell, Grid, load_grid
from harness.config.ledger import Case, Ledger, ledger_cases, ledgers_for_grid
from harness.config.protocol import Protocol, apply_overrides
from harness.engine.run.data import prepare_splits
from harness.engine.run.recorder import InMemoryRecorder
from harness.engine.run.run_config import RunConfig
from harness.engine.run.runtime import resolve_device
from harness.engine.run.trainer import Trainer
from harness.reports.stats import t_interval

__all__ = [
    "EFFECT_METRICS",
    "Effect",
    "measure_deviations",
    "measurable_deviations",
    "effect_lines",
    "effect_sentences",
]

#: The test metrics whose paired differences are reported.
EFFECT_METRICS = ("precision_at_1", "mean_average_precision_at_r")
_SHORT = {"precision_at_1": "P@1", "mean_average_precision_at_r": "MAP@R"}


@dataclass(frozen=True)
class Effect:
    """One deviation on one smoke cell (``cell``: ``method/loss``): the settings switched,
    ``{metric: (mean, half-width, n)}`` of the paired differences in points, or why there
    is no measurement (``reason``)."""

    deviation: str
    cell: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    differences: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    reason: str = ""


@dataclass
class _Runner:
    """Untracked runs of smoke cells, each (protocol, cell, seed) once."""

    device: str
    data_root: Any
    log: Callable[[str], None]
    splits: dict[tuple, DatasetSplits] = field(default_factory=dict)
    done: dict[tuple, tuple[dict[str, float], dict[str, Any]]] = field(default_factory=dict)

    def scores(self, protocol: Protocol, cell: Cell, seed: int, grid: Grid) -> dict[str, float]:
        return self._run(protocol, cell, seed, grid)[0]

    def _run(self, protocol: Protocol, cell: Cell, seed: int, grid: Grid):
        key = (protocol.canonical_json(), cell.method, cell.loss, cell.dataset, seed)
        if key in self.done:
            return self.done[key]
        base_state = None
        if cell.base_key:  # a test-time cell evaluates its base cell's weights
            base = next(c for c in grid.cells if c.key == cell.base_key)
            base_state = self._run(protocol, base, seed, grid)[1]
        started = time.monotonic()
        trainer = self._trainer(protocol, cell, seed, evaluate_only=base_state is not None)
        if base_state is not None:
            trainer.model.load_state_dict(base_state)
        trainer.fit()
        scores = trainer.test(trainer.load_selected_weights())
        result = (
            {m: 100 * float(scores[m]) for m in EFFECT_METRICS},
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        )
        self.log(
            f"measure: {cell.method}/{cell.loss} seed {seed} ({time.monotonic() - started:.0f} s)"
        )
        self.done[key] = result
        return result

    def _trainer(self, protocol: Protocol, cell: Cell, seed: int, *, evaluate_only: bool):
        split_key = (cell.dataset, repr(protocol.splits), protocol.selection.mode, seed)
        if split_key not in self.splits:
            self.splits[split_key] = prepare_splits(
                protocol, cell.dataset, self.data_root, seed=seed
            )
        cfg = RunConfig.build(
            protocol,
            method=cell.method,
            dataset=cell.dataset,
            loss=cell.loss,
            seed=seed,
            method_options=protocol.methods.get(cell.method, {}),
            evaluate_only=evaluate_only,
        )
        device = resolve_device(self.device)
        return Trainer.from_config(
            cfg, self.splits[split_key], recorder=InMemoryRecorder(), device=device
        )


def _paper_case(cases: list[Case], grid: Grid, cell: Cell) -> Case | None:
    """The paper's cell a smoke cell stands for: its method and loss on the paper grid's
    first dataset and backbone (or its own where the paper grid has them)."""
    datasets = grid.paper_axes.get("datasets", [cell.dataset])
    backbones = grid.paper_axes.get("backbones", [cell.backbone])
    dataset = cell.dataset if cell.dataset in datasets else datasets[0]
    backbone = cell.backbone if cell.backbone in backbones else backbones[0]
    return next(
        (
            c
            for c in cases
            if (c.method, c.loss, c.dataset, c.backbone)
            == (cell.method, cell.loss, dataset, backbone)
        ),
        None,
    )


def _authors_settings(ledgers: list[Ledger], deviation: str, case: Case | None) -> dict[str, Any]:
    """The protocol keys and values the ledgers' entries naming ``deviation`` give ``case``."""
    if case is None:
        return {}
    return {
        e.key: e.value
        for ledger in ledgers
        for e in ledger.entries
        if e.deviation == deviation and e.applies(case)
    }


def _deviation_effects(
    deviation: str,
    grid: Grid,
    cells: list[Cell],
    cases: list[Case],
    ledgers: list[Ledger],
    run: Callable[[Protocol, Cell, int], dict[str, float]],
    seeds: tuple[int, ...],
) -> list[Effect]:
    """The effects of one deviation on each smoke cell it changes."""
    effects = []
    for cell in cells:
        case = _paper_case(cases, grid, cell)
        if deviation not in cell.paper_deviations and (
            case is None or deviation not in case.deviations
        ):
            continue
        settings = _authors_settings(ledgers, deviation, case)
        if not settings:
            continue
        label = f"{cell.method}/{cell.loss}"
        try:
            switched, _ = apply_overrides(cell.protocol, settings)
        except HarnessError as err:
            effects.append(Effect(deviation, label, settings, reason=f"not runnable here: {err}"))
            continue
        if switched.canonical_json() == cell.protocol.canonical_json():
            reason = "the smoke protocol already runs the authors' value"
            effects.append(Effect(deviation, label, settings, reason=reason))
            continue
        if _inert_schedule(cell.protocol, switched):
            reason = "only StepLR steps after the smoke run's last epoch change"
            effects.append(Effect(deviation, label, settings, reason=reason))
            continue
        grids_protocol = cell.protocol
        if _inert_window(grids_protocol, switched):
            epochs = _window_epochs(grids_protocol, switched)
            if epochs is None:
                reason = "the smoke run evaluates the same epochs either way"
                effects.append(Effect(deviation, label, settings, reason=reason))
                continue
            # The window acts only on a run long enough to evaluate an epoch it closes:
            # both arms run that many epochs, and the row says so.
            grids_protocol, switched = (_lengthened(p, epochs) for p in (grids_protocol, switched))
            settings = {**settings, "schedule.epochs (both arms)": epochs}
        pairs = [(run(switched, cell, s), run(grids_protocol, cell, s)) for s in seeds]
        differences = {
            m: t_interval([ours[m] - theirs[m] for ours, theirs in pairs]) for m in EFFECT_METRICS
        }
        effects.append(Effect(deviation, label, settings, differences))
    return effects


def _inert_schedule(before: Protocol, after: Protocol) -> bool:
    """Whether the two protocols differ only in schedule steps that fall after the last
    epoch of both (so the runs are the same)."""
    epochs = before.schedule.epochs
    same = dataclasses.replace(
        after,
        schedule=dataclasses.replace(
            after.schedule, milestones=before.schedule.milestones, gamma=before.schedule.gamma
        ),
    )
    steps = [m for m in (*before.schedule.milestones, *after.schedule.milestones) if m < epochs]
    return same.canonical_json() == before.canonical_json() and not steps


def _inert_window(before: Protocol, after: Protocol) -> bool:
    """Whether the two protocols differ only in the selection window, and the window leaves
    the same epochs to evaluate (a smoke run of one epoch: its last alone either way)."""
    epochs = before.schedule.epochs
    same = dataclasses.replace(after, selection=before.selection)
    due = [[e for e in range(1, epochs + 1) if p.selection.due(e, epochs)] for p in (before, after)]
    return same.canonical_json() == before.canonical_json() and due[0] == due[1]


#: The longest run a selection window is lengthened to so that it acts (smoke scale).
WINDOW_EPOCHS_MAX = 10


def _window_epochs(before: Protocol, after: Protocol) -> int | None:
    """The fewest epochs, past the smoke run's and up to :data:`WINDOW_EPOCHS_MAX`, at
    which the two selections evaluate different epochs (None if there is none)."""
    for epochs in range(before.schedule.epochs + 1, WINDOW_EPOCHS_MAX + 1):
        due = [
            [e for e in range(1, epochs + 1) if p.selection.due(e, epochs)] for p in (before, after)
        ]
        if due[0] != due[1]:
            return epochs
    return None


def _lengthened(protocol: Protocol, epochs: int) -> Protocol:
    """``protocol`` run for ``epochs`` epochs."""
    return dataclasses.replace(
        protocol, schedule=dataclasses.replace(protocol.schedule, epochs=epochs)
    )


def measure_deviations(
    grid_name: str,
    *,
    seeds: tuple[int, ...] = (0, 1, 2),
    device: str = "auto",
    data_root: Any = None,
    log: Callable[[str], None] = print,
    ledgers: list[Ledger] | None = None,
    only: str | None = None,
) -> list[Effect]:
    """Every deviation of grid ``grid_name`` (a name or a path) measured on its smoke
    version over ``seeds`` (see the module docstring), in deviation-name order; the
    authors' values from ``ledgers`` (default: the shipped ledgers that cover the grid).
    ``only``: that deviation alone."""
    grid, cells, cases, ledgers = _smoke_cells(grid_name, ledgers)
    unmeasured = {name: why for ledger in ledgers for name, why in ledger.unmeasured.items()}
    runner = _Runner(device, data_root, log)

    def run(protocol: Protocol, cell: Cell, seed: int) -> dict[str, float]:
        return runner.scores(protocol, cell, seed, grid)

    names = [n for n in _names(grid, cells, cases) if only is None or n == only]
    effects: list[Effect] = []
    for name in names:
        if name in unmeasured:
            effects.append(Effect(name, reason=unmeasured[name]))
            continue
        found = _deviation_effects(name, grid, cells, cases, ledgers, run, seeds)
        reason = "no ledger entry sets it on the cells the smoke grid stands for (their dataset and backbone)"
        effects += found or [Effect(name, reason=reason)]
    return effects


def _smoke_cells(
    grid_name: str, ledgers: list[Ledger] | None
) -> tuple[Grid, list[Cell], list[Case], list[Ledger]]:
    """The smoke grid, its cells of one seed, the ledgers' cases of the paper grid, the
    ledgers (default: the shipped ones that cover the grid)."""
    grid = load_grid(grid_name, smoke=True, max_cells=None)
    if ledgers is None:
        ledgers = ledgers_for_grid(load_grid(grid_name, max_cells=None).name)
    if not ledgers:
        raise HarnessError(
            f"grid {grid_name} has no recipe ledger to take the authors' values from"
        )
    cases = [c for ledger in ledgers for c in ledger_cases(ledger, [grid_name], max_cells=None)]
    first = grid.cells[0].seed
    return grid, [c for c in grid.cells if c.seed == first], cases, ledgers


def _names(grid: Grid, cells: list[Cell], cases: list[Case]) -> list[str]:
    """The deviations of the smoke cells and of the paper's cells they stand for (a
    deviation scoped to the paper's backbone, GoogLeNet's, is measured on the smoke
    backbone), less the smoke version's own."""
    found = {n for c in cells for n in c.paper_deviations}
    for cell in cells:
        case = _paper_case(cases, grid, cell)
        found |= set(case.deviations) if case is not None else set()
    return sorted(n for n in found if not n.startswith("smoke_"))


def measurable_deviations(grid_name: str, ledgers: list[Ledger] | None = None) -> list[str]:
    """The deviations :func:`measure_deviations` reports for grid ``grid_name``."""
    grid, cells, cases, _ = _smoke_cells(grid_name, ledgers)
    return _names(grid, cells, cases)


def effect_lines(grid_name: str, effects: list[Effect], seeds: tuple[int, ...]) -> list[str]:
    """The effects as a Markdown table: one row per deviation and cell, the paired
    differences in points (authors' value minus the grid's) with their 95% intervals."""
    head = " | ".join(f"delta {_SHORT[m]} (95% CI)" for m in EFFECT_METRICS)
    lines = [
        f"deviations of {grid_name} switched to the authors' value, smoke scale, seeds "
        f"{', '.join(map(str, seeds))} (paired differences in points, authors' minus grid's):",
        f"| deviation | cell | settings | {head} | n |",
        "|---|---|---|" + "---|" * len(EFFECT_METRICS) + "---|",
    ]
    for e in effects:
        settings = ", ".join(f"{k} = {v}" for k, v in e.settings.items())
        if e.reason:
            lines.append(
                f"| {e.deviation} | {e.cell or '-'} | {settings or '-'} | not measured: {e.reason} |"
                + " |" * (len(EFFECT_METRICS) - 1)
                + " - |"
            )
            continue
        cols = " | ".join(
            f"{mean:+.2f} +- {hw:.2f}" for mean, hw, _ in (e.differences[m] for m in EFFECT_METRICS)
        )
        n = e.differences[EFFECT_METRICS[0]][2]
        lines.append(f"| {e.deviation} | {e.cell} | {settings} | {cols} | {n} |")
    return lines


def effect_sentences(effects: list[Effect]) -> dict[str, str]:
    """One sentence per deviation for the tables' notes: each cell's paired differences
    (authors' value minus the grid's, points, 95% interval), or why it is not measured."""
    found: dict[str, list[str]] = {}
    for e in effects:
        if e.reason:
            found.setdefault(e.deviation, []).append(
                f"{e.cell + ' ' if e.cell else ''}not measured ({e.reason})"
            )
            continue
        parts = ", ".join(
            f"{_SHORT[m]} {mean:+.2f} +- {hw:.2f}"
            for m, (mean, hw, _) in ((m, e.differences[m]) for m in EFFECT_METRICS)
        )
        found.setdefault(e.deviation, []).append(f"{e.cell} {parts}")
    return {name: "; ".join(items) for name, items in found.items()}
