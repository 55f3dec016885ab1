"""The estimate ``sweep`` prints before its first cell, and on a CPU the refusal of a grid
estimated at more than an hour: one line, nothing queued or recorded."""

from __future__ import annotations

import uuid
from pathlib import Path

import mlflow
import pytest

from harness.cli.main import main

TINY_PROTOCOL = Path(__file__).parents[1] / "protocols" / "tiny.toml"


pytestmark = pytest.mark.usefixtures("estimates")


def _grid(tmp: Path, extra: str = "") -> tuple[Path, str]:
    """A grid of one ``plain`` cell under the tiny protocol, with its own experiment."""
    name = f"tiny-{uuid.uuid4().hex[:6]}"
    path = tmp / "grid.toml"
    path.write_text(
        f'name = "{name}"\nprotocol = "{TINY_PROTOCOL}"\nmethods = ["plain"]\n'
        'losses = ["margin"]\nbackbones = ["efficientnet_lite0"]\ndatasets = ["synthetic"]\n'
        f"seeds = [0]\n{extra}"
    )
    return path, name


def _runs(experiment: str) -> list:
    exp = mlflow.MlflowClient().get_experiment_by_name(experiment)
    return [] if exp is None else mlflow.MlflowClient().search_runs([exp.experiment_id])


def test_a_grid_over_an_hour_on_a_cpu_is_one_line_and_queues_nothing(workdir, capsys):
    grid, name = _grid(workdir, '[set]\n"schedule.epochs" = 100000\n')
    storage = workdir / "queue.db"
    argv = ["sweep", "--grid", str(grid), "--storage", f"sqlite:///{storage}", "--device", "cpu"]
    argv += ["--checkpoint-root", str(workdir / "checkpoints")]
    capsys.readouterr()
    assert main(argv) == 2
    # The harness's own lines: MLflow logs its tables' creation where this test makes the
    # process's first store.
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.strip() and " INFO mlflow." not in line]
    assert len(lines) == 1, lines
    assert (
        lines[0].startswith("error: estimated ")
        and "plain's training of 100,000 epochs" in lines[0]
    )
    assert "pass --yes to run it anyway" in lines[0]
    assert not storage.exists() and _runs(name) == []


def test_a_sweep_prints_its_estimate_before_its_first_cell(workdir, capsys):
    grid, name = _grid(workdir, '[set]\n"schedule.epochs" = 1\n')
    argv = ["sweep", "--grid", str(grid), "--storage", f"sqlite:///{workdir / 'queue.db'}"]
    assert main([*argv, "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "estimate: about " in err and " on cpu for 1 run " in err
    assert "per method: plain " in err
    assert err.index("estimate: about ") < err.index("plain seed 0 epoch 1/1")
    assert len(_runs(name)) == 1
    assert main([*argv, "--device", "cpu"]) == 0  # its cell finished: nothing to estimate
    assert "estimate: about" not in capsys.readouterr().err
