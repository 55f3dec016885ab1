"""A few of the fault-injection scenarios under pytest (all of them, with the table:
``python benchmarks/fault_injection.py``). Each injects a fault into the real command
line, restarts it the normal way and checks the row: recovered, final metrics identical
to an uninterrupted run's, no cell run twice, no run left RUNNING, nothing half-written
read."""

from __future__ import annotations

import signal

import pytest

from .lab import Lab
from .run_faults import RunFaults
from .sweep_faults import SweepFaults
from .tune_faults import TuneFaults

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lab(tmp_path_factory, data_root):
    lab = Lab(tmp_path_factory.mktemp("faults"), data_root, seed=0)
    yield lab
    lab.close()


@pytest.fixture(scope="module")
def run_faults(lab) -> RunFaults:
    faults = RunFaults(lab)
    faults.prepare()
    return faults


@pytest.mark.parametrize(
    "point, n, action",
    [("write:last.pt", 2, "kill"), ("evaluate", 3, "term"), ("write:last.pt", 2, "enospc")],
)
def test_run_survives_a_fault_at_a_named_point(run_faults, point, n, action):
    row = run_faults.hook(point, n, action)
    assert row.ok, row


def test_run_survives_a_sigkill_at_a_random_moment(run_faults):
    row = run_faults.random_signal(signal.SIGKILL)
    assert row.ok, row


def test_a_truncated_checkpoint_restarts_the_run_from_scratch(run_faults):
    row = run_faults.damaged_checkpoint("truncated")
    assert row.ok, row


def test_a_sweep_of_three_workers_killed_at_a_checkpoint_write_finishes_every_cell_once(lab):
    faults = SweepFaults(lab)
    faults.prepare()
    row = faults.hook("write:last.pt", 2, "kill")
    assert row.ok, row


def test_tune_interrupted_mid_trial_ends_with_the_uninterrupted_study(lab):
    faults = TuneFaults(lab)
    faults.prepare()
    row = faults.hook("train_batch", 8, "term")
    assert row.ok, row
