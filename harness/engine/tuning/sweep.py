"""A tuned grid (``[tune]``, :mod:`harness.config.tuning`) swept end to end: every
(backbone, loss, method, dataset) searched with the same budget of trials on
class-disjoint folds of the training classes, then its best setting trained with each of
the grid's seeds and scored on the test classes.

It follows Musgrave et al., "A Metric Learning Reality Check" (MLRC, ECCV 2020), Sec. 4.2
and 4.3, and powerful-benchmarker's two phases:

* **Search.** One Optuna study per (backbone, loss, method, dataset) in the sweep's RDB
  storage, named :attr:`Study.name`. A *trial* is one task of the sweep's queue (the same
  queue, workers, heartbeats and Slurm array as an untuned grid's cells,
  :mod:`harness.engine.grid.sweep`): its k fold runs, in order, each trained on the other
  folds' classes and selected on its own (the test split sealed: a run that read it would
  fail), scored by the mean over folds of each run's best validation ``metric``. A trial
  of round r (``number // round``) is suggested only once every trial of the earlier
  rounds is settled, by TPE fitted on exactly those, seeded by (``sampler_seed``,
  number): a study's trials are the same whatever the number of workers, the order they
  finish in, or the restarts in between. The pruner (between folds) compares with the
  same trials only. Trial runs are recorded in the experiment ``<experiment>-search``.
* **Final.** Once every study of the grid has its whole budget, each cell (a study and a
  seed) trains the best trial's setting (highest value, the lowest trial number on a
  tie): with ``folds = 1`` one run, on the protocol's validation split, in the grid's
  experiment; with k folds, k runs (fold i selected on fold i) in ``<experiment>-folds``,
  and two results in the grid's experiment that the tables read: ``separated`` (the mean
  of the k models' test metrics, MLRC's per-model report) and ``concatenated`` (the k
  models' L2-normalised embeddings joined, MLRC's 4 x 128 = 512-d report). A test-time
  cell (``[test_time]``, DIML) evaluates its base cell's final runs the same way.

Every run carries ``tune_study``, ``tune_trial``, ``tune_fold`` and ``tune_role`` tags
(``trial`` or ``final``); final results also the budget, the chosen setting and the
study's values by trial (``tune_budget``, ``tune_params``, ``tune_history``), from which
the tables write their notes, the appendix of chosen settings and the best-so-far figure.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from harness.base.errors import HarnessError
from harness.components.data import check_fold_splits
from harness.config.grids import Cell, Grid
from harness.config.protocol import apply_overrides
from harness.engine.grid.queue import (
    Heartbeat,
    fail_lost_trials,
    hold_trial,
    pop_lock,
    settle_trial,
)
from harness.engine.grid.sweep import worker_loop
from harness.engine.run.data import check_folds_fit, check_training_split, prepare_splits
from harness.engine.tuning.runs import run_final_cell, run_trial
from harness.engine.tuning.studies import (
    Study,
    finished_final_cells,
    log,
    record_storage,
    record_study,
    round_start,
    settled,
    tuned_studies,
)

__all__ = [
    "TASK_ATTR",
    "plan_tasks",
    "tuned_worker_loop",
    "study_progress",
    "unfinished_tuned_cells",
    "run_worker",
    "check_tuned_grid",
    "check_tuned_folds",
    "check_search_size",
]


#: The queue trial's user attribute naming its task: ``trial`` or ``final``.


TASK_ATTR = "tune_task"


def _queue_trials(queue) -> dict[str, list]:

    by: dict[str, list] = {s.name: [] for s in TrialState}
    for t in queue.get_trials(deepcopy=False):
        if TASK_ATTR in t.user_attrs:
            by[t.state.name].append(t)
    return by


def _task_id(attrs: dict[str, Any]) -> tuple:
    if attrs[TASK_ATTR] == "trial":
        return ("trial", attrs["tune_study"], int(attrs["tune_trial"]))
    return ("final", attrs["cell_key"])


def plan_tasks(
    grid: Grid, queue, storage, *, retry_failed: bool = True, finals: bool = True
) -> dict[str, Any]:
    """Queue what can run now and is neither settled nor queued nor running: each study's
    trials whose earlier rounds are settled; once every study has its whole budget, the
    final cells (a test-time cell once its base cell is final; none without ``finals``:
    the search alone). A task that failed is queued again only with ``retry_failed`` (a
    sweep's start; its workers leave it for the next start, as an untuned grid's failed
    cells). Returns what it found."""

    fail_lost_trials(queue)  # a dead worker's task is queued again
    by = _queue_trials(queue)
    pending = {_task_id(t.user_attrs) for t in by["WAITING"] + by["RUNNING"]}
    if not retry_failed:  # failed with an error (not interrupted, not stale: those are retried)
        pending |= {
            _task_id(t.user_attrs)
            for t in by["FAIL"]
            if t.user_attrs.get("error") not in (None, "interrupted")
        }
    # Read first, also where no study is complete yet: a new tracking store is created here,
    # once, before workers start (two creating it at once would race on its tables).
    finished = finished_final_cells(grid)
    studies = tuned_studies(grid)
    queued, complete = _plan_trials(studies, queue, storage, pending)
    ready = finals and complete == len(studies)
    final_count = _plan_finals(studies, queue, pending, finished) if ready else 0
    return {
        "studies": len(studies),
        "complete": complete,
        "trials_queued": queued,
        "finals_queued": final_count,
        "finals_done": len(finished),
        "pending": len(pending),
    }


def _plan_trials(studies: list[Study], queue, storage, pending: set) -> tuple[int, int]:
    """Queue each study's trials that are ready (their earlier rounds settled); returns
    ``(trials queued, studies complete)``."""
    queued = complete = 0
    for study in studies:
        spec = study.spec
        done = settled(record_study(study, storage))
        if len(done) >= study.trials:
            complete += 1
            continue
        for number in range(study.trials):
            ready = all(n in done for n in range(round_start(spec, number)))
            if number in done or ("trial", study.name, number) in pending or not ready:
                continue
            queue.enqueue_trial(
                {},
                user_attrs={TASK_ATTR: "trial", "tune_study": study.name, "tune_trial": number},
            )
            queued += 1
    return queued, complete


def _plan_finals(studies: list[Study], queue, pending: set, finished: set[str]) -> int:
    """Queue the final cells not finished nor pending (a test-time cell once its base
    cell is final); returns how many."""
    queued = 0
    for study in studies:
        for cell in (*study.cells, *study.dependents):
            if cell.key in finished or ("final", cell.key) in pending:
                continue
            if cell.base_key and cell.base_key not in finished:
                continue
            queue.enqueue_trial(
                {}, user_attrs={TASK_ATTR: "final", "cell_key": cell.key, "cell": cell.label}
            )
            queued += 1
    return queued


def tuned_worker_loop(
    grid: Grid,
    queue,
    storage,
    *,
    settings: dict | None = None,
    poll: float = 2.0,
    train: Any = None,
    finals: bool = True,
) -> dict[str, list]:
    """Pop and run the tuned grid's tasks until every study and final cell is done (with
    ``finals`` False: every study), or nothing more can run; plans new tasks whenever the
    queue is empty (``train``: what trains a run, default
    :func:`~harness.engine.run.training.train_run`). Returns this worker's
    ``{"done": [...], "failed": [(task, error)]}``."""

    settings = settings or {}
    report: dict[str, list] = {"done": [], "failed": []}
    cache: dict = {}
    while True:
        if not _queue_trials(queue)["WAITING"]:
            with pop_lock(settings.get("storage")):
                plan_tasks(grid, queue, storage, retry_failed=False, finals=finals)
            by = _queue_trials(queue)  # planned now, or a dead worker's task queued again
            if by["WAITING"]:
                continue
            if not by["RUNNING"]:
                # Nothing runs now; a task that ended since the plan above may have readied
                # the next round (it records before it ends): plan once more, then stop.
                with pop_lock(settings.get("storage")):
                    plan_tasks(grid, queue, storage, retry_failed=False, finals=finals)
                if _queue_trials(queue)["WAITING"]:
                    continue
                return report
            time.sleep(poll)
            continue
        with pop_lock(settings.get("storage")):
            task = queue.ask()
        if TASK_ATTR not in task.user_attrs:  # another worker took the last queued task
            queue.tell(task, state=TrialState.FAIL)
            continue
        hold_trial(task, settings)
        with Heartbeat(queue._storage, task._trial_id):
            _work_on_task(grid, queue, storage, task, (settings, cache, train), report)


def _work_on_task(grid, queue, storage, task, how: tuple, report) -> None:
    """Run one popped task (``how``: the worker's settings, its splits cache and what
    trains a run) and settle it in the queue."""
    settings, cache, train = how
    attrs = task.user_attrs
    twins = [
        t
        for t in _queue_trials(queue)["RUNNING"]
        if _task_id(t.user_attrs) == _task_id(attrs) and t.number < task.number
    ]
    if twins:
        queue.tell(task, state=TrialState.PRUNED)
        return
    name = (
        f"{attrs['tune_study']} trial {attrs['tune_trial']}"
        if attrs[TASK_ATTR] == "trial"
        else f"final {attrs['cell']}"
    )
    try:
        if attrs[TASK_ATTR] == "trial":
            study = next(s for s in tuned_studies(grid) if s.name == attrs["tune_study"])
            value = run_trial(study, int(attrs["tune_trial"]), storage, settings, cache, train)
        else:
            cell = next(c for c in grid.cells if c.key == attrs["cell_key"])
            run_final_cell(grid, cell, storage, settings, cache, train)
            value = 0.0
    except KeyboardInterrupt:
        settle_trial(queue, task, state=TrialState.FAIL, error="interrupted")
        raise
    except StopIteration:
        settle_trial(queue, task, state=TrialState.FAIL, error="not in the grid any more")
        return
    except Exception as err:
        text = f"{type(err).__name__}: {err}".strip().splitlines()[0][:500]
        log(f"FAILED {name}: {text}")
        settle_trial(queue, task, state=TrialState.FAIL, error=text)
        report["failed"].append((name, text))
        return
    # A pruned trial's task ended as it should: its queue entry is told a number, not NaN.
    settle_trial(queue, task, value=value if math.isfinite(value) else 0.0)
    report["done"].append(name)


def study_progress(grid: Grid, storage) -> list[dict[str, Any]]:
    """Per study: finished, pruned and running trials, and the best value so far."""

    queue_running: dict[str, int] = {}
    try:
        queue = optuna.load_study(study_name=f"sweep:{grid.name}", storage=storage)
        for t in _queue_trials(queue)["RUNNING"]:
            if t.user_attrs.get(TASK_ATTR) == "trial":
                name = t.user_attrs["tune_study"]
                queue_running[name] = queue_running.get(name, 0) + 1
    except KeyError:  # no queue yet
        pass
    out = []
    for study in tuned_studies(grid):
        done = settled(record_study(study, storage))
        complete = [t for t in done.values() if t.state == TrialState.COMPLETE]
        out.append(
            {
                "study": study.label,
                "finished": len(complete),
                "pruned": len(done) - len(complete),
                "running": queue_running.get(study.name, 0),
                "budget": study.trials,
                "best": max((float(t.value) for t in complete), default=None),
            }
        )
    return out


def unfinished_tuned_cells(grid: Grid) -> list[Cell]:
    finished = finished_final_cells(grid)
    return [c for c in grid.cells if c.key not in finished]


def run_worker(
    grid: Grid, queue, *, settings: dict | None = None, train: Any = None
) -> dict[str, list]:
    """A worker of the grid's queue: :func:`tuned_worker_loop` for a tuned grid, else
    :func:`harness.engine.grid.sweep.worker_loop` (``train``: what trains a cell's run)."""

    settings = settings or {}
    if grid.tune is None:
        return worker_loop(grid, queue, settings=settings, train=train)
    return tuned_worker_loop(
        grid, queue, record_storage(settings.get("storage")), settings=settings, train=train
    )


def check_tuned_folds(grid: Grid, data_root: Path | None, *, flag: str = "") -> None:
    """A tuned grid's folds against what each dataset tells without loading or generating
    its images (:func:`~harness.engine.run.data.check_folds_fit`): checked before the
    datasets are read, so a set generated on first use is not generated for a grid it
    cannot serve. A refusal names the grid's ``tune.folds``, or ``flag`` (``--``: the
    command's ``--folds``) where the command gave the folds."""
    assert grid.tune is not None
    for cell in _one_cell_per_dataset(grid):
        _for_cell(grid, cell, flag, check_folds_fit, cell.dataset, data_root, grid.tune.folds)


def check_tuned_grid(grid: Grid, settings: dict, *, flag: str = "") -> None:
    """What a tuned grid needs of its data, checked on the loaded splits before anything
    is queued: with ``folds = 1`` a batch that fits in the training split, else enough
    training classes for its folds (two per fold) and no validation split of a dataset's
    own, in every dataset (``flag``: as for :func:`check_tuned_folds`)."""

    assert grid.tune is not None
    for cell in _one_cell_per_dataset(grid):
        if grid.tune.folds == 1:
            splits = prepare_splits(
                cell.protocol, cell.dataset, settings.get("data_root"), seed=cell.seed
            )
            check_training_split(cell.protocol, cell.dataset, splits)
            continue
        whole, _ = apply_overrides(cell.protocol, {"selection.mode": "last"})
        splits = prepare_splits(whole, cell.dataset, settings.get("data_root"), seed=cell.seed)
        _for_cell(grid, cell, flag, check_fold_splits, splits, grid.tune.folds)


def _one_cell_per_dataset(grid: Grid) -> list[Cell]:
    """The first cell of each dataset and split rule of the grid."""
    cells: dict[tuple[str, str], Cell] = {}
    for cell in grid.cells:
        cells.setdefault((cell.dataset, repr(cell.protocol.splits)), cell)
    return list(cells.values())


def _for_cell(grid: Grid, cell: Cell, flag: str, check, *args) -> None:
    """``check(*args)``, its refusal (``folds = ...``) said of the grid's ``tune.folds``
    on the cell's dataset, or of ``flag``."""
    try:
        check(*args)
    except HarnessError as err:
        if flag:
            raise HarnessError(f"{flag}{err}") from None
        raise HarnessError(f"grid {grid.name}, dataset {cell.dataset}: tune.{err}") from None


def check_search_size(grid: Grid, max_runs: int | None) -> None:
    """A tuned grid's search of more than ``max_runs`` training runs (every study's
    trials times the folds each trains; None: no cap) is refused, as a grid of more cells
    than its cap is: most likely a budget written by mistake."""
    assert grid.tune is not None
    studies = tuned_studies(grid)
    trials = sum(s.trials for s in studies)
    runs = trials * grid.tune.folds
    if max_runs is not None and runs > max_runs:
        raise HarnessError(
            f"grid {grid.name}'s search has {runs:,} trial runs ({len(studies)} studies, "
            f"{trials:,} trials in all x {grid.tune.folds} fold(s)), more than {max_runs:,} "
            f"(each a training run); check its [tune] table, or give --yes to sweep them all"
        )
