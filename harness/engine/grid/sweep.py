"""``python -m harness sweep --grid NAME``: run every cell of a grid exactly once,
restartable, across local worker processes or machines.

Coordination uses an Optuna RDB storage as the shared queue (SQLite under
``results/`` by default; a PostgreSQL URL shares it across machines):

* one study per grid (``sweep:<grid>``); each cell that has no FINISHED MLflow run
  (tag ``cell_key``) and no queued or running trial is enqueued as a fixed trial
  (``study.enqueue_trial``, the cell key in its user attributes);
* workers pop trials with ``study.ask()``, run the cell through
  :func:`harness.engine.run.training.train_run` (``resume=True``: a retried cell continues
  from its last checkpoint) and ``study.tell()`` the selection metric;
* workers send Optuna heartbeats; a worker killed mid-cell leaves a RUNNING trial
  whose heartbeat goes stale, Optuna fails it and
  ``RetryHeartbeatStaleTrialCallback`` (``RetryFailedTrialCallback`` before Optuna 4.9)
  re-queues it, so another worker
  (or the next start) runs the cell; a trial whose worker (``host:pid``, recorded on it)
  is a process of this host that has ended is failed and re-queued the same way at once,
  without waiting for its heartbeat
  (:func:`harness.engine.grid.queue.fail_lost_trials`);
* a cell that raises is reported, its trial failed, and it is queued again on the
  next start;
* a test-time-only cell (grid ``[test_time]``, e.g. DIML on a trained ``plain``) is
  queued once its base cell has a FINISHED run: by the start that finds it so, or by
  any worker (on any machine) that finds the queue empty; a cell whose base failed
  waits, and the final report says so.

The tracking store is the record of what is done: a restarted sweep skips every
cell with a FINISHED run carrying its ``cell_key`` and creates no new runs for it.
The same workers run as the tasks of a Slurm job array (:mod:`harness.engine.grid.cluster`);
what differs there is :mod:`harness.engine.grid.cells`'s.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from harness.base.atomic import atomic_write_json
from harness.base.errors import HarnessError
from harness.base.metric_keys import group_metrics
from harness.config.deviations import deviation_tags
from harness.config.fingerprint import fingerprint
from harness.config.grids import Cell, Grid
from harness.engine.grid.cells import cell_output, job_of_this_task, train_in_processes
from harness.engine.grid.queue import (
    Heartbeat,
    fail_lost_trials,
    hold_trial,
    pop_lock,
    settle_trial,
)
from harness.engine.run import training
from harness.engine.run.data import check_training_split, prepare_splits
from harness.engine.run.run_config import RunConfig, RunSettings
from harness.methods import METHODS
from harness.store.environment import optuna_storage_setting, slurm_ids
from harness.store.location import DEFAULT_STORAGE
from harness.store.queries import all_runs, search_runs, set_run_tags, terminate_run
from harness.store.tracking import filter_value as q

try:  # Optuna >= 4.9 renamed the callback and its argument
    from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry

    RETRY_ARGUMENT = "heartbeat_stale_trial_callback"
except ImportError:
    from optuna.storages import RetryFailedTrialCallback as Retry

    RETRY_ARGUMENT = "failed_trial_callback"

__all__ = [
    "open_storage",
    "open_study",
    "storage_url",
    "finished_cells",
    "enqueue_cells",
    "enqueue_ready_dependents",
    "queue_grid",
    "worker_loop",
    "run_cell",
    "cell_run_config",
    "run_cell_process",
    "runs_of_cell",
    "tag_cell",
    "unfinished_cells",
    "CELL_ATTR",
]

CELL_ATTR = "cell_key"


def _log(msg: str) -> None:
    print(f"[sweep {socket.gethostname()}:{os.getpid()}] {msg}", file=sys.stderr, flush=True)


def storage_url(url: str | None) -> str:
    url = url or optuna_storage_setting() or DEFAULT_STORAGE
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        folder = Path(url.removeprefix("sqlite:///").split("?", 1)[0]).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise HarnessError(
                f"cannot open the Optuna storage {url}: cannot create its folder {folder} "
                f"({err.strerror or err})"
            ) from None
    if url.startswith(("postgresql://", "postgres://")):
        # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; use psycopg2 when that is
        # the driver installed.

        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2"):
            url = "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def open_storage(
    storage: str | None,
    *,
    heartbeat: int | None = 30,
    grace: int | None = 90,
    retry_stale: bool = True,
):
    """An Optuna RDB storage (SQLite by default) with worker heartbeats; stale trials are
    failed and, with ``retry_stale``, queued again."""

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Heartbeats and fail_stale_trials are "experimental" in Optuna since 2.8; ask() warns
    # that heartbeats are meant for optimize() (we send them ourselves, see Heartbeat).
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    retry: dict[str, Any] = {RETRY_ARGUMENT: Retry(max_retry=None)}
    url = storage_url(storage)
    engine = (
        {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    )
    try:  # two workers creating one new SQLite storage at once would race on its tables
        with pop_lock(url):
            return RDBStorage(
                url,
                engine_kwargs=engine,
                heartbeat_interval=heartbeat,
                grace_period=grace,
                **(retry if retry_stale else {}),
            )
    except Exception as err:  # unreachable server, missing driver, bad URL
        raise HarnessError(
            f"cannot open the Optuna storage {url}: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        ) from None


def open_study(grid: Grid, storage: str | None, *, heartbeat: int = 30, grace: int = 90):
    """The grid's study (``sweep:<grid>``) on an RDB storage with heartbeats and retry of stale trials."""

    return optuna.create_study(
        study_name=f"sweep:{grid.name}",
        storage=open_storage(storage, heartbeat=heartbeat, grace=grace),
        direction="maximize",
        load_if_exists=True,
    )


def finished_cells(grid: Grid) -> dict[str, str]:
    """``{cell_key: run_id}`` of FINISHED runs of the grid in the tracking store."""
    out: dict[str, str] = {}
    for run in all_runs(grid.experiment, "attributes.status = 'FINISHED'"):
        key = run.data.tags.get(CELL_ATTR)
        if key:
            out.setdefault(key, run.info.run_id)
    return out


def _trials_by_state(study) -> dict[str, list]:

    by: dict[str, list] = {s.name: [] for s in TrialState}
    for t in study.get_trials(deepcopy=False):
        if CELL_ATTR in t.user_attrs:
            by[t.state.name].append(t)
    return by


def enqueue_cells(grid: Grid, study) -> dict[str, Any]:
    """Queue every cell without a FINISHED run and without a queued or running trial
    whose base cell (if it has one) is finished.

    Returns counts, the cells that failed on an earlier start (now retried) and the
    cells still waiting for their base cell."""

    fail_lost_trials(study)
    done = finished_cells(grid)
    by = _trials_by_state(study)
    pending = {t.user_attrs[CELL_ATTR] for t in by["WAITING"] + by["RUNNING"]}
    failed_before = {t.user_attrs[CELL_ATTR] for t in by["FAIL"]}
    queued, retried, waiting = [], [], []
    for cell in grid.cells:
        if cell.key in done or cell.key in pending:
            continue
        if cell.base_key and cell.base_key not in done:
            waiting.append(cell)
            continue
        study.enqueue_trial({}, user_attrs={CELL_ATTR: cell.key, "cell": cell.label})
        queued.append(cell)
        if cell.key in failed_before:
            retried.append(cell)
    return {
        "total": len(grid.cells),
        "finished": sum(c.key in done for c in grid.cells),
        "queued": len(queued),
        "pending": len(pending),
        "retried": retried,
        "waiting": waiting,
    }


def queue_grid(grid: Grid, study, storage: str) -> dict[str, Any]:
    """:func:`enqueue_cells`, saying what it found: how many cells are finished, queued,
    pending or waiting, and which failed cells are retried (``storage``: the study's URL)."""
    with pop_lock(storage):  # two sweeps started at once queue each cell once
        counts = enqueue_cells(grid, study)
    _log(
        f"grid {grid.name}: {counts['total']} cells, {counts['finished']} finished (skipped), "
        f"{counts['queued']} queued, {counts['pending']} already queued or running, "
        f"{len(counts['waiting'])} waiting for their base cell; "
        f"experiment '{grid.experiment}', storage {storage}"
    )
    for cell in counts["retried"]:
        _log(f"retrying {cell.label} (failed on an earlier start)")
    return counts


def enqueue_ready_dependents(grid: Grid, study) -> int:
    """Queue the test-time cells whose base cell has finished and that have no trial in
    this study yet (one that failed waits for the next start, as any failed cell)."""
    waiting = [c for c in grid.cells if c.base_key]
    if not waiting:
        return 0
    done = finished_cells(grid)
    tried = {t.user_attrs[CELL_ATTR] for ts in _trials_by_state(study).values() for t in ts}
    ready = [c for c in waiting if c.base_key in done and c.key not in done and c.key not in tried]
    for cell in ready:
        study.enqueue_trial({}, user_attrs={CELL_ATTR: cell.key, "cell": cell.label})
    return len(ready)


def runs_of_cell(grid: Grid, cell: Cell, fp: str, status: str) -> list:
    """Runs of the grid's experiment that ran this cell (same protocol fingerprint, which
    covers protocol, deviations, split, loss and its arguments; same method and seed)."""

    return search_runs(
        grid.experiment,
        (
            f"attributes.status = {q(status)} and tags.fingerprint = {q(fp)} and tags.method = {q(cell.method)} "
            f"and tags.seed = {q(cell.seed)} and tags.dataset = {q(cell.dataset)}"
        ),
    )


def tag_cell(run_id: str, grid: Grid, cell: Cell, trial_number: int, study_name: str) -> None:
    set_run_tags(
        run_id,
        {
            CELL_ATTR: cell.key,
            "grid": grid.name,
            "grid_cell": cell.label,
            "grid_variant": "; ".join(f"{k}={v}" for k, v in cell.variant.items()),
            "optuna_study": study_name,
            "optuna_trial": trial_number,
        },
    )


def run_cell(
    grid: Grid,
    cell: Cell,
    trial_number: int,
    study_name: str,
    settings: dict,
    splits_cache: dict,
    train: Any = None,
):
    """Train the cell's run (``train``: :func:`~harness.engine.run.training.train_run`, or a
    stand-in), or adopt a finished untagged one; the run tagged with the cell and trial."""

    splits = _cell_splits(cell, settings, splits_cache)
    fp = fingerprint(cell.protocol, splits.digest(), loss=cell.loss, loss_args=cell.loss_args)
    init_from = finished_cells(grid).get(cell.base_key, "") if cell.base_key else ""
    adopted = _adopt_finished(grid, cell, fp, init_from, trial_number, study_name)
    if adopted is not None:
        return adopted
    _kill_dead_runs(grid, cell, fp)
    if cell.base_key and not init_from:
        raise HarnessError(f"{cell.label}: its base cell {cell.base_key} has no finished run")
    if settings.get("processes", 1) > 1:  # one process per GPU of the task, under torchrun
        record = train_in_processes(grid.path, grid.smoke, cell.key, settings)
    else:
        train = train or training.train_run
        record = train(cell_run_config(grid, cell, settings, init_from), splits)
    tag_cell(record["mlflow_run_id"], grid, cell, trial_number, study_name)
    return record


def run_cell_process(grid: Grid, key: str, settings: dict, record: Path) -> None:
    """One of the processes ``torchrun`` starts for a cell on several GPUs: the cell's run
    as :func:`run_cell` builds it, trained through the DDP path of ``run``. The worker that
    started them holds the cell's trial and tags the run; process 0 writes the record."""

    cell = next((c for c in grid.cells if c.key == key), None)
    if cell is None:
        raise HarnessError(f"grid {grid.name} has no cell {key}")
    init_from = finished_cells(grid).get(cell.base_key, "") if cell.base_key else ""
    splits = _cell_splits(cell, settings, {})
    result = training.train_run(cell_run_config(grid, cell, settings, init_from), splits)
    if result:  # process 0
        atomic_write_json(record, result)


def _cell_splits(cell: Cell, settings: dict, splits_cache: dict):
    """The cell's splits, prepared once per key in ``splits_cache``, the batch rule of the
    cell's protocol checked on them."""

    protocol = cell.protocol
    # A protocol that carves validation by the run's seed has one split per seed.
    split_key = (
        cell.dataset,
        repr(protocol.splits),
        protocol.selection.mode,
        str(settings.get("data_root")),
        cell.seed if protocol.splits.validation_by_run_seed else None,
    )
    if split_key not in splits_cache:
        splits_cache[split_key] = prepare_splits(
            protocol, cell.dataset, settings.get("data_root"), seed=cell.seed
        )
    check_training_split(protocol, cell.dataset, splits_cache[split_key])
    return splits_cache[split_key]


def _adopt_finished(
    grid: Grid, cell: Cell, fp: str, init_from: str, trial_number: int, study_name: str
) -> dict | None:
    """The record of a finished run of the cell that no worker tagged (its worker was killed
    after the run finished), tagged now; None when there is none. Only a run of the same code
    (method revision) from the same weights is adopted."""

    revision = str(METHODS.get(cell.method).cls.revision)
    for run in runs_of_cell(grid, cell, fp, "FINISHED"):
        tags = run.data.tags
        if (
            CELL_ATTR not in tags
            and tags.get("method_revision", "1") == revision
            and tags.get("init_from", "none") == (init_from or "none")
        ):
            tag_cell(run.info.run_id, grid, cell, trial_number, study_name)
            _log(f"{cell.label}: adopted finished untagged run {run.info.run_id}")
            return {
                "mlflow_run_id": run.info.run_id,
                "metrics": group_metrics(run.data.metrics, "test"),
            }
    return None


def _kill_dead_runs(grid: Grid, cell: Cell, fp: str) -> None:
    """Runs left RUNNING by a killed worker: no live worker owns them (the cell's trial is
    ours now); marked KILLED (a checkpointed one is resumed and runs again)."""
    for run in runs_of_cell(grid, cell, fp, "RUNNING"):
        terminate_run(run.info.run_id, "KILLED")
        _log(f"{cell.label}: run {run.info.run_id} of a dead worker marked KILLED")


def cell_run_config(grid: Grid, cell: Cell, settings: dict, init_from: str = "") -> RunConfig:
    """The training run of the cell (``settings``: the worker's, as
    :meth:`~harness.engine.run.run_config.RunSettings.of_worker` reads them): resumable,
    from ``init_from`` (evaluation only for a cell with a base cell), tagged with the cell
    from the start."""

    return RunConfig.build(
        cell.protocol,
        method=cell.method,
        dataset=cell.dataset,
        loss=cell.loss,
        seed=cell.seed,
        deviations=cell.deviations,
        settings=RunSettings.of_worker(settings),
        method_options=cell.method_options,
        protocol_path=cell.protocol_path,
        resume=True,
        init_from=init_from,
        evaluate_only=bool(cell.base_key),
        experiment=grid.experiment,
        # Tagged from the start; the full set again after the run (and on adoption).
        tags={
            CELL_ATTR: cell.key,
            "grid": grid.name,
            "grid_cell": cell.label,
            **deviation_tags(cell.paper_deviations, cell.method, cell.dataset),
            **slurm_ids(),  # the job that ran (or, resumed, finished) the cell
        },
    )


def worker_loop(
    grid: Grid, study, *, settings: dict | None = None, poll: float = 2.0, train: Any = None
) -> dict[str, list]:
    """Pop and run queued cells until none is queued or running anywhere.

    ``settings["storage"]``: the study's storage URL (a SQLite one gets a local pop lock).
    ``train``: what trains a cell's run (default :func:`~harness.engine.run.training.train_run`).
    Returns ``{"done": [...], "failed": [(label, error)], "skipped": [...]}`` for this worker."""

    # Import the training stack (torch, timm, MLflow: seconds of work, much of it holding
    # the GIL) before holding a trial: imported inside the first cell, it starved that
    # trial's heartbeat thread past a short grace period, and another worker failed the
    # live trial as stale and ran its cell a second time.

    settings = settings or {}
    cells = {c.key: c for c in grid.cells}
    report: dict[str, list] = {"done": [], "failed": [], "skipped": []}
    splits_cache: dict = {}
    while True:
        with pop_lock(settings.get("storage")):
            fail_lost_trials(study)
        by = _trials_by_state(study)
        if not by["WAITING"]:
            if not by["RUNNING"]:
                if enqueue_ready_dependents(grid, study):
                    continue
                return report
            time.sleep(poll)  # another worker may die: its cell would come back here
            continue
        with pop_lock(settings.get("storage")):
            trial = study.ask()
        key = trial.user_attrs.get(CELL_ATTR)
        if key is None:  # another worker took the last queued cell first
            study.tell(trial, state=TrialState.FAIL)
            continue
        hold_trial(trial, settings)
        with Heartbeat(study._storage, trial._trial_id):
            _work_on_trial(
                grid, study, trial, cells.get(key), settings, splits_cache, report, train
            )


def _work_on_trial(
    grid: Grid,
    study,
    trial,
    cell: Cell | None,
    settings: dict,
    splits_cache: dict,
    report: dict[str, list],
    train: Any = None,
) -> None:
    """Run the cell of a popped ``trial`` and tell the study how it ended, or end the trial
    without running it (a cell no longer in the grid, or one finished or running
    elsewhere); the outcome goes into ``report``."""

    key = trial.user_attrs[CELL_ATTR]
    if cell is None:
        trial.set_user_attr("error", "cell not in the grid any more")
        study.tell(trial, state=TrialState.FAIL)
        return
    twins = [
        t
        for t in _trials_by_state(study)["RUNNING"]
        if t.user_attrs.get(CELL_ATTR) == key and t.number < trial.number
    ]
    if twins or key in finished_cells(grid):
        report["skipped"].append(cell.label)
        trial.set_user_attr("skipped", "already finished or running elsewhere")
        study.tell(trial, state=TrialState.PRUNED)
        return
    _log(f"trial {trial.number}: {cell.label} (cell {key})")
    header = f"trial {trial.number}, job {job_of_this_task(settings) or 'none'}, {time.ctime()}"
    try:
        with cell_output(settings.get("cell_logs"), cell.label, header):
            record = run_cell(
                grid, cell, trial.number, study.study_name, settings, splits_cache, train
            )
    except KeyboardInterrupt:
        settle_trial(study, trial, state=TrialState.FAIL, error="interrupted")
        raise
    except Exception as err:
        text = f"{type(err).__name__}: {err}".strip().splitlines()[0][:500]
        _log(f"FAILED {cell.label}: {text}")
        settle_trial(study, trial, state=TrialState.FAIL, error=text)
        report["failed"].append((cell.label, text))
        return
    metric = cell.protocol.selection.metric
    settle_trial(
        study,
        trial,
        value=float(record["metrics"].get(metric, 0.0)),
        run_id=record["mlflow_run_id"],
    )
    report["done"].append(cell.label)


def unfinished_cells(grid: Grid, study) -> list[tuple[Cell, str]]:
    """The grid's cells without a FINISHED run, each with why: its trial's error, "not
    run", or the base cell it waits for."""
    done = finished_cells(grid)
    labels = {c.key: c.label for c in grid.cells}
    failed = {
        t.user_attrs[CELL_ATTR]: t.user_attrs.get("error", "")
        for t in _trials_by_state(study)["FAIL"]
    }
    out = []
    for cell in grid.cells:
        if cell.key in done:
            continue
        reason = failed.get(cell.key, "not run")
        if cell.base_key and cell.base_key not in done:
            reason = f"waiting for its base cell {labels.get(cell.base_key, cell.base_key)}"
        out.append((cell, reason or "failed"))
    return out
