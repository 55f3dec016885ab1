"""The studies of a tuned grid (:mod:`harness.engine.tuning.sweep`): one per (backbone,
loss, method, dataset), the record of its settled trials in the sweep's RDB storage, and
the setting of each trial, a function of the earlier rounds' trials alone."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState, create_trial

from harness.base.errors import HarnessError
from harness.config.grids import Cell, Grid
from harness.config.tuning import TPE_STARTUP_TRIALS, TuneSpec, suggest_setting
from harness.engine.grid.sweep import open_storage
from harness.store.queries import all_runs

__all__ = [
    "Study",
    "tuned_studies",
    "search_experiment",
    "search_seed",
    "search_cell",
    "folds_experiment",
    "record_study",
    "record_storage",
    "settled",
    "round_start",
    "is_random_trial",
    "search_summary",
    "trial_setting",
    "fold_plan",
    "best_trial",
    "finished_final_cells",
    "log",
]


def log(msg: str) -> None:
    print(f"[tune {socket.gethostname()}:{os.getpid()}] {msg}", file=sys.stderr, flush=True)


def search_seed(grid: Grid) -> int:
    """The seed every trial of the grid's searches trains with: one above the highest seed
    of its cells, so that no final run (a cell's seed) repeats a trial run, and the
    reported seeds are runs apart from the search that chose their setting."""
    return max(c.seed for c in grid.cells) + 1


def search_cell(study: Study) -> Cell:
    """The cell a study's trials train: its first cell, with :func:`search_seed`."""
    return replace(study.first, seed=search_seed(study.grid))


def search_experiment(grid: Grid) -> str:
    return f"{grid.experiment}-search"


def folds_experiment(grid: Grid) -> str:
    return f"{grid.experiment}-folds"


@dataclass(frozen=True)
class Study:
    """The cells of one (backbone, loss, method, dataset) of a tuned grid (one per seed)
    and the test-time cells that evaluate their final runs."""

    grid: Grid
    cells: tuple[Cell, ...]
    dependents: tuple[Cell, ...] = field(default=())

    @property
    def spec(self) -> TuneSpec:
        assert self.grid.tune is not None
        return self.grid.tune

    @property
    def first(self) -> Cell:
        return self.cells[0]

    @cached_property
    def dimensions(self) -> int:
        """The dimensions of the study's space (the parameters its first trial draws)."""
        return len(trial_setting(self, 0, {})[1])

    @property
    def trials(self) -> int:
        """The study's budget: the grid's trials, or its trials per dimension times
        :attr:`dimensions`."""
        if not self.spec.trials_per_dimension:  # no space to measure: the planner asks often
            return self.spec.trials
        return self.spec.trials_for(self.dimensions)

    @property
    def label(self) -> str:
        c = self.first
        return f"{c.backbone}/{c.loss}/{c.method}/{c.dataset}"

    @property
    def name(self) -> str:
        return f"tune:{self.grid.name}:{self.label}:{self.first.study_key}"


def tuned_studies(grid: Grid) -> list[Study]:
    """The grid's studies, in the grid's cell order; every trained cell is in one."""
    if grid.tune is None:
        raise HarnessError(f"grid {grid.name} has no [tune] table")
    trained: dict[str, list[Cell]] = {}
    for cell in grid.cells:
        if not cell.base_key:
            trained.setdefault(cell.study_key, []).append(cell)
    by_cell = {c.key: k for k, cells in trained.items() for c in cells}
    dependents: dict[str, list[Cell]] = {}
    for cell in grid.cells:
        if cell.base_key:
            dependents.setdefault(by_cell[cell.base_key], []).append(cell)
    return [
        Study(grid, tuple(sorted(cells, key=lambda c: c.seed)), tuple(dependents.get(k, ())))
        for k, cells in trained.items()
    ]


def record_study(study: Study, storage):

    return optuna.create_study(
        study_name=study.name, storage=storage, direction="maximize", load_if_exists=True
    )


def settled(record) -> dict[int, Any]:
    """``{trial number: FrozenTrial}`` of a study's settled trials (finished or pruned)."""

    out: dict[int, Any] = {}
    for t in record.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        out.setdefault(int(t.user_attrs["number"]), t)
    return out


def round_start(spec: TuneSpec, number: int) -> int:
    return (number // spec.round) * spec.round


def is_random_trial(spec: TuneSpec, number: int) -> bool:
    """Whether trial ``number`` was sampled at random: the trials TPE was fitted on (those of
    the earlier rounds) were fewer than :data:`TPE_STARTUP_TRIALS`."""
    return round_start(spec, number) < TPE_STARTUP_TRIALS


def search_summary(spec: TuneSpec, record, best) -> dict[str, Any]:
    """What a study's search was, for the tables: the space's ``dimensions``, its settled
    trials ``completed`` / ``pruned`` / ``random`` (sampled before TPE had
    :data:`TPE_STARTUP_TRIALS` to fit), and the budget check (MLRC's question whether the
    search had converged): ``late_gain``, how much the best value rose over the last
    quarter of the trials, against ``fold_noise``, the standard error of the best trial's
    mean over its folds (both in percent points; NaN with one fold), and ``converged``
    (the late gain within the fold noise)."""
    history = settled(record)
    numbers = sorted(history)
    values = [
        history[n].value if history[n].state == TrialState.COMPLETE else None for n in numbers
    ]
    best_so_far = np.maximum.accumulate([-np.inf if v is None else v for v in values])
    quarter = len(numbers) - max(1, len(numbers) // 4)
    before = best_so_far[quarter - 1] if quarter > 0 else -np.inf
    late_gain = 100.0 * float(best_so_far[-1] - before) if np.isfinite(before) else float("nan")
    folds = [float(v) for v in best.user_attrs.get("fold_values", [])]
    noise = (
        100.0 * float(np.std(folds, ddof=1) / np.sqrt(len(folds)))
        if len(folds) > 1
        else float("nan")
    )
    return {
        "dimensions": len(best.distributions),
        "completed": sum(v is not None for v in values),
        "pruned": sum(v is None for v in values),
        "random": sum(is_random_trial(spec, n) for n in numbers),
        "late_gain": round(late_gain, 4),
        "fold_noise": round(noise, 4),
        "converged": bool(late_gain <= noise) if not np.isnan(noise + late_gain) else None,
    }


def trial_setting(study: Study, number: int, history: dict[int, Any]):
    """The setting of trial ``number``: ``(params, distributions, options, overrides)``,
    suggested by TPE fitted on the settled trials of the earlier rounds (``history``),
    added in trial order, and seeded by (``sampler_seed``, ``number``)."""

    spec = study.spec
    earlier = range(round_start(spec, number))
    missing = [n for n in earlier if n not in history]
    if missing:
        raise HarnessError(
            f"study {study.label}: trial {number} needs trials {missing} settled first"
        )
    seed = int(np.random.SeedSequence([spec.sampler_seed, number]).generate_state(1)[0])
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    memory = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=TPE_STARTUP_TRIALS),
    )
    for n in earlier:
        t = history[n]
        memory.add_trial(
            create_trial(
                params=t.params,
                distributions=t.distributions,
                value=t.value if t.state == TrialState.COMPLETE else None,
                intermediate_values=t.intermediate_values,
                state=t.state,
            )
        )
    trial = memory.ask()
    first = study.first
    options, overrides = suggest_setting(trial, spec, first.method, first.loss, first.protocol)
    return dict(trial.params), dict(trial.distributions), options, overrides


def fold_plan(grid: Grid) -> list[int | None]:
    """The folds each trial and final cell trains: ``[None]`` (the protocol's validation
    split) for ``folds = 1``, else ``[0, ..., k - 1]``."""
    assert grid.tune is not None
    return [None] if grid.tune.folds == 1 else list(range(grid.tune.folds))


def best_trial(record) -> Any:
    """The study's best finished trial: the highest value, the lowest number on a tie."""

    done = [t for t in settled(record).values() if t.state == TrialState.COMPLETE]
    if not done:
        raise HarnessError(f"study {record.study_name} has no finished trial (all pruned)")
    return max(done, key=lambda t: (t.value, -int(t.user_attrs["number"])))


def finished_final_cells(grid: Grid) -> set[str]:
    """Keys of the cells with their final result(s) in the grid's experiment: the run
    (``folds = 1``), or both the ``separated`` and the ``concatenated`` result."""

    reports: dict[str, set[str]] = {}
    for run in all_runs(grid.experiment, "attributes.status = 'FINISHED'"):
        tags = run.data.tags
        if tags.get("tune_role") == "final" and tags.get("cell_key"):
            reports.setdefault(tags["cell_key"], set()).add(tags.get("tune_report", "single"))
    assert grid.tune is not None
    want = {"single"} if grid.tune.folds == 1 else {"separated", "concatenated"}
    return {key for key, have in reports.items() if want <= have}


def record_storage(url: str | None):
    """The storage of the studies' records: the queue's database, without heartbeats."""

    return open_storage(url, heartbeat=None, grace=None, retry_stale=False)
