"""The trials of a sweep's queue (:mod:`harness.engine.grid.sweep`) as its workers hold them:
the lock that pops one trial per worker on SQLite, the heartbeat a worker sends for the
trial it holds, the worker recorded on it (``host:pid`` and its cluster job), how it ends,
and the trials whose worker is gone, queued again: at once where the worker was a process
of this host that has ended, after the grace period of its heartbeat elsewhere.

A tuned grid's tasks (:mod:`harness.engine.tuning.sweep`) are trials of the same queue and
are held, settled and retried the same way.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import sys
import threading
from typing import Any

from filelock import FileLock
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import fail_stale_trials
from optuna.trial import TrialState

from harness.engine.grid.cells import job_of_this_task
from harness.store.dead_runs import process_is_dead, worker_id

__all__ = [
    "WORKER_ATTR",
    "pop_lock",
    "Heartbeat",
    "hold_trial",
    "queued_attrs",
    "fail_lost_trials",
    "settle_trial",
]

#: A queue trial's user attributes naming the worker process that holds it (``host:pid``)
#: and the trial they were recorded on: a retried trial inherits its predecessor's
#: attributes, so a worker recorded on another trial does not hold it.
WORKER_ATTR = "worker"
_HELD_ATTR = "worker_trial"
#: The user attributes a worker sets on the trial it holds, and how the trial ended.
_HOLDER_ATTRS = (WORKER_ATTR, _HELD_ATTR, "job", "error", "skipped", "mlflow_run_id")


def _log(msg: str) -> None:
    print(f"[sweep {socket.gethostname()}:{os.getpid()}] {msg}", file=sys.stderr, flush=True)


def pop_lock(url: str | None):
    """Serialise popping a queued trial among the processes of one machine on SQLite (and
    creating the storage, and queueing the cells).

        Optuna pops a WAITING trial with ``SELECT ... FOR UPDATE``, which SQLite ignores: two
        workers that ask at the same moment can both get the same trial and run the cell
        twice. PostgreSQL (the storage across machines) honours the row lock; on SQLite an
        exclusive lock on a file beside the database does the same for local workers.

        ``url``: the storage URL the study was opened with
        (:func:`harness.engine.grid.sweep.storage_url`), passed in rather than read back from
        Optuna's storage objects (private, and wrapped in a cache).
        The lock is the maintained ``filelock`` package's (``flock`` on POSIX, ``msvcrt`` on
        Windows), released when the block ends or the process dies."""
    if not url or not url.startswith("sqlite:///") or url == "sqlite:///:memory:":
        return contextlib.nullcontext()

    return FileLock(url.removeprefix("sqlite:///") + ".pop.lock")


class Heartbeat:
    """Record an Optuna heartbeat for one trial every ``interval`` seconds in a thread."""

    def __init__(self, storage, trial_id: int):
        self.storage, self.trial_id = storage, trial_id
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        interval = self.storage.get_heartbeat_interval() or 30
        while True:
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception as err:  # a transient database error must not kill the run
                _log(f"heartbeat failed: {err}")
            if self.stop.wait(interval):
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def hold_trial(trial, settings: dict) -> None:
    """Record on a popped ``trial`` the worker that holds it: this process (``host:pid``,
    which tells a dead holder of this host, :func:`fail_lost_trials`) and its cluster job
    (for ``sweep --status``; "": a worker started by hand). Set on every trial, since a
    retried trial inherits its predecessor's."""
    trial.set_user_attr(WORKER_ATTR, worker_id())
    trial.set_user_attr(_HELD_ATTR, trial.number)
    trial.set_user_attr("job", job_of_this_task(settings))


def queued_attrs(trial) -> dict[str, Any]:
    """The user attributes that say what a queue trial runs (a cell, or a tuned grid's
    task), without those of the worker that held it or of how it ended: what a trial
    queued again for the same work carries."""
    return {k: v for k, v in trial.user_attrs.items() if k not in _HOLDER_ATTRS}


def fail_lost_trials(study) -> list[int]:
    """Fail the RUNNING trials of ``study`` whose worker is gone, each queued again by the
    storage's retry callback (a storage opened with ``retry_stale``): a trial whose
    heartbeat is older than the grace period (its worker on any host) and, at once, one
    whose worker is a process of this host that no longer runs (SIGKILL, the
    out-of-memory killer, a cancelled task). Returns the numbers of the latter."""

    fail_stale_trials(study)
    storage = study._storage
    dead = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        held = trial.user_attrs.get(_HELD_ATTR) == trial.number
        if not held or not process_is_dead(str(trial.user_attrs.get(WORKER_ATTR, ""))):
            continue
        try:
            if storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                dead.append(trial._trial_id)
        except UpdateFinishedTrialError:  # ended meanwhile, by its worker or another process
            continue
    getter = getattr(storage, "get_heartbeat_stale_trial_callback", None)  # Optuna >= 4.9
    retry = (getter or storage.get_failed_trial_callback)()
    numbers = []
    for trial_id in dead:
        failed = copy.deepcopy(storage.get_trial(trial_id))
        attrs = failed.user_attrs
        what = attrs.get("cell") or f"{attrs.get('tune_study')} trial {attrs.get('tune_trial')}"
        _log(
            f"trial {failed.number} ({what}): its worker {attrs[WORKER_ATTR]} "
            f"ended without finishing it; {'queued again' if retry else 'failed'}"
        )
        if retry is not None:
            retry(study, failed)
        numbers.append(failed.number)
    return numbers


def settle_trial(
    study, trial, *, state=None, value: float | None = None, error: str = "", run_id: str = ""
) -> None:
    """Tell the study how ``trial`` ended, unless it was already ended under this worker:
    a heartbeat late past the grace period (an overloaded machine) makes another worker
    fail the live trial as stale and queue it again. Telling then raised, which killed
    this worker and left the queue with fewer workers than cells waiting (the flaky
    "3 of 4 cells finished"). The run this worker finished stays the cell's; the queued
    retry finds it FINISHED and skips the cell."""

    try:
        if study._storage.get_trial(trial._trial_id).state != TrialState.RUNNING:
            raise UpdateFinishedTrialError
        if error:
            trial.set_user_attr("error", error)
        if run_id:
            trial.set_user_attr("mlflow_run_id", run_id)
        if value is None:
            study.tell(trial, state=state, skip_if_finished=True)
        else:
            study.tell(trial, value, skip_if_finished=True)
    except UpdateFinishedTrialError:
        _log(
            f"trial {trial.number} was failed as stale by another worker while it ran here (heartbeat "
            f"late by more than the grace period); its retry skips the cell once this run is FINISHED"
        )
