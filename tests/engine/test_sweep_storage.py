"""Two sweeps started at the same instant on a new SQLite storage: both create and open it
(Optuna's tables are made once, under the storage's file lock) and queue each cell once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.config.grids import load_grid
from harness.engine.grid.sweep import CELL_ATTR, open_study
from tests.conftest import TINY_PROTOCOL

ROOT = Path(__file__).resolve().parents[2]

# One sweep's start: open (creating) the storage, then queue the grid's cells; it starts
# at the instant given, as a second `sweep` started together does.
START = textwrap.dedent("""
    import sys, time
    from harness.config.grids import load_grid
    from harness.engine.grid.sweep import open_study, queue_grid
    grid_path, storage, at = sys.argv[1], sys.argv[2], float(sys.argv[3])
    grid = load_grid(grid_path)
    time.sleep(max(0.0, at - time.time()))
    study = open_study(grid, storage)
    queue_grid(grid, study, storage)
""")


@pytest.mark.slow  # 14 s on 2 cores: two sweep processes
def test_two_sweeps_started_together_on_a_new_sqlite_storage_both_work(tmp_path):
    grid_path = tmp_path / "grid.toml"
    grid_path.write_text(
        f'name = "race-{os.getpid()}"\nprotocol = "{TINY_PROTOCOL}"\nmethods = ["plain", '
        '"ngrouping"]\nlosses = ["margin"]\nbackbones = ["efficientnet_lite0"]\n'
        'datasets = ["synthetic"]\nseeds = [0, 1]\n'
    )
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    at = str(time.time() + 8)  # both have imported everything by then
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", START, str(grid_path), storage, at],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    errors = [p.communicate(timeout=300)[1] for p in starts]
    assert [p.returncode for p in starts] == [0, 0], errors
    assert not any("IntegrityError" in e for e in errors), errors
    grid = load_grid(grid_path)
    study = open_study(grid, storage)
    queued = sorted(t.user_attrs[CELL_ATTR] for t in study.get_trials(deepcopy=False))
    assert queued == sorted(c.key for c in grid.cells)  # each cell once
