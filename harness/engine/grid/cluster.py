"""``sweep --executor slurm|local``: a grid's cells run by the tasks of one job array,
submitted through submitit (its ``SlurmExecutor``, or its ``LocalExecutor`` on this
machine, which runs the same tasks as processes).

Every task runs the sweep's worker loop (:func:`harness.engine.grid.sweep.worker_loop`) against
the grid's queue: it pops a cell, runs it, pops the next, and ends when the queue is empty.
The queue, not the array, decides who runs what, so the queue's guarantees hold on the
cluster as on one machine:

* a task killed mid-cell (``scancel``, whose SIGTERM ends it at once; a node lost; the
  out-of-memory killer) stops sending its trial's heartbeat; another task, or the next
  start, fails the trial and queues the cell again, which then resumes from its last
  checkpoint: at once where that task runs on the killed task's node (its process is
  gone, :func:`harness.engine.grid.queue.fail_lost_trials`), else once the heartbeat is
  ``--grace`` seconds old;
* a task preempted or out of time gets submitit's signal: :meth:`SweepTask.checkpoint`
  hands its cell back to the queue at once (no wait for the heartbeat to go stale) and
  submitit requeues the task, which comes back as a worker like any other;
* a cell with a FINISHED run is never run again, whichever task looks at it.

What a sweep submitted is kept beside the tracking store, under ``sweeps/<grid>/``
(``results/sweeps/<grid>/`` by default): ``jobs.json`` (the arrays, for ``--status`` and
``--cancel``), ``cells/`` (each cell's stdout and stderr, :func:`harness.engine.grid.cells.cell_output`)
and ``submitit/`` (each task's own log, and submitit's pickles). On a cluster that folder,
the queue and the tracking store must be reachable from every node.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import submitit
import torch
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from harness.base.atomic import atomic_write_json
from harness.base.errors import HarnessError
from harness.config.executor import slurm_minutes
from harness.config.grids import Grid, load_grid
from harness.engine.grid.cells import job_of_this_task
from harness.engine.grid.queue import queued_attrs
from harness.engine.grid.slurm import SlurmOptions
from harness.engine.grid.sweep import open_storage, open_study
from harness.store.dead_runs import fail_dead_runs
from harness.store.environment import carried_environment
from harness.store.location import artifact_root

__all__ = [
    "check_local_gpus",
    "EXECUTORS",
    "TaskSpec",
    "SweepTask",
    "sweep_folder",
    "read_jobs",
    "submit_tasks",
    "release_trials",
    "executor_parameters",
    "DEFAULT_MINUTES",
]

EXECUTORS = ("slurm", "local")
#: A task's time limit when neither the options, the grid nor the partition gives one.
DEFAULT_MINUTES = 24 * 60


def sweep_folder(grid: Grid) -> Path:
    """``sweeps/<grid>/`` beside the tracking store (``results/sweeps/<grid>`` by default):
    the sweep's submitted jobs, each cell's output and submitit's files."""

    return artifact_root().parent / "sweeps" / grid.name


@dataclass(frozen=True)
class TaskSpec:
    """What one array task needs to become a worker of the sweep: plain data, pickled by
    submitit into the job's folder."""

    grid: str
    smoke: bool
    #: The grid's name (its study is ``sweep:<name>``).
    name: str
    storage: str
    heartbeat: int
    grace: int
    #: The worker settings (:func:`harness.engine.grid.sweep.worker_loop`).
    settings: dict[str, Any]
    #: What a task runs: ``worker(grid, study, settings=...)`` takes the queue's cells
    #: until it is empty and returns them by outcome (a tuned grid's worker also runs its
    #: search trials); given by the command, so that grids need not know tuning.
    worker: Callable[..., dict[str, list]]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)


class SweepTask(submitit.helpers.Checkpointable):
    """One task of the array: a worker of the sweep's queue until the queue is empty.

    A :class:`submitit.helpers.Checkpointable`: on preemption or at its time limit submitit
    calls :meth:`checkpoint`, then requeues the task with what it returns."""

    def __init__(self, spec: TaskSpec):
        self.spec = spec

    def __call__(self) -> dict[str, int]:
        spec = self.spec
        # Told to stop (scancel: Slurm's SIGTERM to every process of the job), the task
        # ends at once, as a killed one: the cell it holds stays RUNNING and another task,
        # or the next start, retries it. submitit's own handler ignores SIGTERM: the task
        # would run on while its data-loading processes die of the same signal, record
        # their deaths as the cell's error (retried by the next start only) and pop the
        # next cell.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(spec.cwd)
        os.environ.update(spec.env)

        settings = {**spec.settings, "job_id": submitit.JobEnvironment().job_id}
        grid = load_grid(spec.grid, smoke=spec.smoke, max_cells=None)
        fail_dead_runs()
        study = open_study(grid, spec.storage, heartbeat=spec.heartbeat, grace=spec.grace)

        report = spec.worker(grid, study, settings=settings)
        return {name: len(items) for name, items in report.items()}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Hand the cell this task holds back to the queue at once (another task, or this
        one once requeued, resumes it from its last checkpoint), then let submitit requeue
        this task as it was submitted."""
        job = job_of_this_task({"job_id": submitit.JobEnvironment().job_id})
        spec = self.spec
        released = release_trials(
            spec.storage,
            spec.name,
            [job],
            "preempted or out of time (its task was requeued)",
            again=True,
        )
        print(f"[sweep task {job}] checkpoint: handed back {released} cell(s)", file=sys.stderr)
        return super().checkpoint(*args, **kwargs)


def release_trials(
    storage_url: str, grid_name: str, jobs: list[str], why: str, *, again: bool
) -> int:
    """End the RUNNING trials of the grid's queue held by ``jobs`` (task ids, as
    :func:`job_of_this_task` names them) as failed, saying ``why``; with ``again``, queue
    their cells anew so that the sweep still runs them. Returns how many trials were ended."""

    jobs = [job for job in jobs if job]  # "": workers started by hand, never released here
    if not jobs:
        return 0
    storage = open_storage(storage_url)
    study = optuna.load_study(study_name=f"sweep:{grid_name}", storage=storage)
    ended = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        work = queued_attrs(trial)  # a cell, or a tuned grid's trial or final cell
        if trial.user_attrs.get("job") not in jobs or not work:
            continue
        try:
            storage.set_trial_user_attr(trial._trial_id, "error", why)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:  # its worker ended it meanwhile
            continue
        ended += 1
        if again:
            study.enqueue_trial({}, user_attrs=work)
    return ended


def check_local_gpus(options: SlurmOptions, available: int | None = None) -> None:
    """The local executor runs every task on this machine: a task asking for more GPUs
    than this machine has (``available``, default: the GPUs torch sees) is refused before
    anything is queued, rather than trained as that many CPU processes."""
    gpus = options.gpus_per_task or 0
    if available is None:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > available:
        raise HarnessError(
            f"--gpus-per-task {gpus}: the local executor runs each task on this machine, which "
            f"has {available} GPU{'s' * (available != 1)}; expected at most {available} "
            f"(0: the task trains on the CPU)"
        )


def executor_parameters(
    kind: str, options: SlurmOptions, minutes: float, grid: Grid
) -> dict[str, Any]:
    """The submitit parameters of each task: one Slurm task (torchrun starts a cell's
    processes inside it) with the options' resources."""
    gpus = options.gpus_per_task or 0
    if kind == "local":
        return {"timeout_min": math.ceil(minutes), "gpus_per_node": gpus, "tasks_per_node": 1}
    params: dict[str, Any] = {
        "job_name": f"harness-{grid.name}",
        "time": math.ceil(minutes),
        "nodes": 1,
        "ntasks_per_node": 1,
    }
    for name in ("partition", "cpus_per_task", "mem", "account", "qos", "array_parallelism"):
        if getattr(options, name) is not None:
            params[name] = getattr(options, name)
    if gpus:
        params["gpus_per_task"] = gpus
    return params


@contextlib.contextmanager
def _importable_harness() -> Iterator[None]:
    """This harness on ``PYTHONPATH`` while the tasks are submitted (they inherit the
    environment): a checkout that is not installed is then importable in the jobs too."""
    root = str(Path(__file__).resolve().parents[2])
    before = os.environ.get("PYTHONPATH")
    parts = [p for p in (before or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *[p for p in parts if p != root]])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@contextlib.contextmanager
def _interruptible_tasks() -> Iterator[None]:
    """SIGINT handled while the tasks are spawned. A sweep started as a shell's background
    job (``... &``) ignores SIGINT, an ignored signal stays ignored across ``exec``, and
    the local executor's tasks would inherit that: ``--cancel`` (SIGINT to each task's
    controller) could not stop them. Handled here, they start with Python's own handler."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)


def task_spec(
    grid: Grid,
    storage: str,
    heartbeat: int,
    grace: int,
    settings: dict,
    worker: Callable[..., dict[str, list]],
) -> TaskSpec:
    """The spec of the grid's tasks, each running ``worker``: this working directory, the
    carried environment, and each cell's output under the sweep's folder."""
    env = carried_environment()
    return TaskSpec(
        grid=str(grid.path),
        smoke=grid.smoke,
        name=grid.name,
        storage=storage,
        heartbeat=heartbeat,
        grace=grace,
        settings={**settings, "cell_logs": str(sweep_folder(grid) / "cells")},
        worker=worker,
        cwd=os.getcwd(),
        env=env,
    )


def submit_tasks(
    kind: str, grid: Grid, spec: TaskSpec, options: SlurmOptions, tasks: int
) -> dict[str, Any]:
    """Submit ``tasks`` workers of the grid as one job array (one job each on the local
    executor) and record them in ``jobs.json``; returns the record."""
    folder = sweep_folder(grid)
    minutes = slurm_minutes(options.time) if options.time else DEFAULT_MINUTES
    executor: submitit.SlurmExecutor | submitit.LocalExecutor
    if kind == "slurm":
        executor = submitit.SlurmExecutor(folder=folder / "submitit")
    else:
        executor = submitit.LocalExecutor(folder=folder / "submitit")
    executor.update_parameters(**executor_parameters(kind, options, minutes, grid))
    try:
        with _importable_harness(), _interruptible_tasks(), executor.batch():
            jobs = [executor.submit(SweepTask(spec)) for _ in range(tasks)]
    except submitit.core.utils.FailedJobError as err:  # sbatch refused after all
        text = " ".join(str(err).split())
        raise HarnessError(f"Slurm refused the sweep's jobs: {text[:400]}") from None
    ids = [job.job_id for job in jobs]
    record = {
        "executor": kind,
        "array": ids[0].split("_")[0],
        "tasks": ids,
        "submitted": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "storage": spec.storage,
    }
    atomic_write_json(folder / "jobs.json", {"jobs": [*read_jobs(grid), record]})
    return record


def read_jobs(grid: Grid) -> list[dict[str, Any]]:
    """The arrays submitted for the grid, oldest first (``jobs.json``); none yet: []."""
    path = sweep_folder(grid) / "jobs.json"
    if not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text(encoding="utf-8"))["jobs"])
    except (ValueError, KeyError, TypeError) as err:
        raise HarnessError(f"cannot read {path}: {err}") from None
