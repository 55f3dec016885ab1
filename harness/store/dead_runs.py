"""Runs whose process died: a run killed outright (SIGKILL, the out-of-memory killer, a
power loss) stays RUNNING in the store; these functions find such runs by the process
that owns them (``host:pid``) and end them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import mlflow
from mlflow.entities import ViewType

from harness.base.atomic import remove_orphans_in
from harness.store.environment import default_checkpoint_root
from harness.store.location import sqlite_database, tracking_uri
from harness.store.tracking import _search_runs

__all__ = [
    "CHECKPOINT_DIR_TAG",
    "under_checkpoint_root",
    "worker_id",
    "process_is_dead",
    "mark_dead_runs_killed",
    "fail_dead_runs",
]

# MLflow is imported inside the functions that use it: importing it takes seconds, which
# commands that never open the store (--help, schema, methods) should not pay.

#: The tag holding a run's checkpoint folder, relative to the checkpoint root (an absolute
#: one, as some records hold, is read as it is): where a killed run's partial files are
#: removed when it is marked FAILED.
CHECKPOINT_DIR_TAG = "checkpoint_dir"


def under_checkpoint_root(recorded: str, root: Path | str | None = None) -> Path | None:
    """Where a path a run recorded (``checkpoint_dir``, ``model_path``) is found: a relative
    one under ``root`` (None: :func:`~harness.store.environment.default_checkpoint_root`),
    an absolute one as recorded. None for an empty tag and for a relative one that would
    leave the root (``..``)."""
    if not recorded:
        return None
    path = Path(recorded)
    if path.is_absolute():
        return path
    if ".." in path.parts:
        return None
    return Path(root if root is not None else default_checkpoint_root()) / path


def worker_id() -> str:
    """This process as ``host:pid``, recorded on the runs it starts (tag ``harness_worker``)
    and on tune's trials: a restart on the same host tells a run whose process was killed
    (SIGKILL leaves it RUNNING) from one a live process still owns."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_is_dead(worker: str) -> bool:
    """Whether ``worker`` (``host:pid``) is a process of this host that no longer runs.
    Another host's process is never declared dead here (its heartbeat decides, in sweeps)."""
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def mark_dead_runs_killed(experiment: str, filter_string: str) -> list[str]:
    """Mark KILLED the RUNNING runs of ``experiment`` matching ``filter_string`` whose
    process (tag ``harness_worker``) died on this host; returns their ids."""

    killed = []
    for run in _search_runs(experiment, f"attributes.status = 'RUNNING' and {filter_string}"):
        if process_is_dead(run.data.tags.get("harness_worker", "")):
            mlflow.MlflowClient().set_terminated(run.info.run_id, status="KILLED")
            killed.append(run.info.run_id)
    return killed


def _ended_without_finishing(worker: str) -> str:
    host, _, pid = worker.rpartition(":")
    return f"process {pid} on {host} ended without finishing the run (killed, out of memory or power lost)"


def fail_dead_runs() -> list[str]:
    """Mark FAILED every RUNNING run (any experiment) whose process died on this host, with
    a ``failure`` tag saying so; returns their ids. Every command that opens the tracking
    store calls this first, so a run killed outright (SIGKILL, the out-of-memory killer, a
    power loss) does not stay RUNNING. ``run --resume`` continues such a run from its last
    checkpoint, in the same MLflow run.

    A run owned by a process of another host cannot be checked by its pid and is left as
    it is (a sweep's own heartbeats fail those cells); so is a run without the
    ``harness_worker`` tag. A store that does not exist yet holds no run and is not created."""

    uri = tracking_uri()
    database = sqlite_database(uri)
    if database is not None and not database.is_file():
        return []
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    experiments = [
        e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)
    ]
    if not experiments:
        return []
    failed = []
    for run in client.search_runs(
        experiments, filter_string="attributes.status = 'RUNNING'", max_results=50000
    ):
        worker = run.data.tags.get("harness_worker", "")
        if process_is_dead(worker):
            client.set_tag(run.info.run_id, "failure", _ended_without_finishing(worker))
            client.set_terminated(run.info.run_id, status="FAILED")
            failed.append(run.info.run_id)
            # a checkpoint the killed process was writing, under this process's root
            folder = under_checkpoint_root(run.data.tags.get(CHECKPOINT_DIR_TAG, ""))
            if folder is not None and folder.is_dir():
                remove_orphans_in(folder)
    return failed
