"""Waiting for a state, not for a number of seconds: a test that acts on a run while it
trains ("mid-cell") polls until the run is open or has logged an epoch, with a generous
timeout, so that a busy machine makes it wait longer instead of acting too early or too late."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import mlflow

from harness.base.metric_keys import metric_key

#: What a run logs at the end of each epoch.
EPOCH_METRIC = metric_key("train", "epoch_loss")


def wait_until(condition: Callable[[], bool], what: str, *, timeout: float = 600) -> None:
    """Poll ``condition`` every 0.2 s until it holds; fail naming ``what`` after ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)


def run_in_progress(experiment: str, *, after_an_epoch: bool = True, **tags: str) -> bool:
    """Whether a run of ``experiment`` with ``tags`` (``cell_key=...``) is RUNNING and, with
    ``after_an_epoch``, has logged an epoch: the process that trains it is mid-run."""
    client = mlflow.MlflowClient(os.environ.get("MLFLOW_TRACKING_URI"))
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return False
    return any(
        run.info.status == "RUNNING"
        and (EPOCH_METRIC in run.data.metrics or not after_an_epoch)
        and all(run.data.tags.get(k) == v for k, v in tags.items())
        for run in client.search_runs([found.experiment_id])
    )
