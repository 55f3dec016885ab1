"""The trials of a sweep's queue as its workers hold them: one pop at a time among a
machine's workers on SQLite, and a trial whose worker died on this host queued again at
once (the sweeps that rely on both are ``test_sweep.py``'s and ``test_tuned_grid.py``'s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import filelock
import optuna
import pytest
from optuna.trial import TrialState

from harness.engine.grid.queue import WORKER_ATTR, fail_lost_trials, hold_trial, pop_lock
from harness.engine.grid.sweep import CELL_ATTR, open_storage

REPO = Path(__file__).resolve().parents[2]


def test_local_workers_pop_trials_under_one_file_lock(tmp_path):
    """On SQLite, popping a trial is serialised by a ``filelock`` lock beside the database,
    named by the storage URL the sweep was given (not read back from Optuna's objects)."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    with pop_lock(url):
        assert (tmp_path / "optuna.db.pop.lock").exists()
        with pytest.raises(filelock.Timeout):  # a second worker (another lock file handle) waits
            pop_lock(url).acquire(timeout=0.2)
    with pop_lock(url):  # released
        pass
    for shared in ("postgresql://u@host/db", "sqlite:///:memory:", None):
        with pop_lock(shared):  # the database's own row lock (or one process) suffices
            pass


def test_a_trial_whose_worker_died_on_this_host_is_queued_again_at_once(tmp_path):
    """A worker killed outright (SIGKILL) leaves its trial RUNNING, long before its
    heartbeat could go stale (grace: an hour); the next look at the queue fails it at once,
    its process being gone, and queues its cell again. A trial whose worker lives is left
    alone, and so is a retry that still carries its dead predecessor's worker (popped, not
    yet held by the worker that popped it)."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(
        study_name="sweep:lost", storage=open_storage(url, grace=3600), direction="maximize"
    )
    for key in ("a", "b"):
        study.enqueue_trial({}, user_attrs={CELL_ATTR: key, "cell": f"cell {key}"})
    worker = (  # pops cell a, holds it, and is killed
        "import os, signal, optuna\n"
        "from harness.engine.grid.sweep import open_storage\n"
        "from harness.engine.grid.queue import hold_trial\n"
        f"queue = optuna.load_study(study_name='sweep:lost', storage=open_storage({url!r}, grace=3600))\n"
        "hold_trial(queue.ask(), {})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, "-c", worker], env=env).returncode == -signal.SIGKILL
    [dead] = study.get_trials(states=(TrialState.RUNNING,))
    live = study.ask()  # cell b, held by this process
    hold_trial(live, {})
    assert fail_lost_trials(study) == [dead.number]
    states = {t.number: (t.state, t.user_attrs[CELL_ATTR]) for t in study.get_trials()}
    assert states[dead.number] == (TrialState.FAIL, "a")
    assert states[live.number] == (TrialState.RUNNING, "b")
    [retry] = [n for n, s in states.items() if s == (TrialState.WAITING, "a")]
    popped = study.ask()  # the retry, by a worker that has not recorded itself yet
    assert popped.number == retry
    assert popped.user_attrs[WORKER_ATTR] == dead.user_attrs[WORKER_ATTR]
    assert fail_lost_trials(study) == []
    assert {t.number for t in study.get_trials(states=(TrialState.RUNNING,))} == {
        live.number,
        retry,
    }
