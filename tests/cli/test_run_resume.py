"""Interrupted and resumed runs of ``python -m harness run``: resume after SIGKILL with the
uninterrupted metrics, into another store or experiment, a shared DIML evaluated again
into its own run, the AMP loss scale in a checkpoint, SIGTERM marking a run KILLED from
either entry point, and a failure tag dropped once the run finishes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch

from harness.base.metric_keys import metric_key
from tests.cli_runs import read_records, run_cli


def _cli_process(workdir: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "harness", "run", *args],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def _wait_for_a_checkpoint(proc: subprocess.Popen, folder: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not list(folder.glob("results/checkpoints/*/last.pt")):
        assert proc.poll() is None, (
            "the run ended before its first checkpoint: " + proc.stderr.read()
        )
        assert time.time() < deadline
        time.sleep(0.02)


def test_resume_into_a_store_without_the_checkpoints_run_records_everything(
    workdir, tiny_protocol, monkeypatch
):
    """Checkpoints outlive a deleted tracking store; resuming one must not leave a bare run."""
    first = workdir / "first.json"
    assert (
        run_cli("--methods", "plain", "--protocol", str(tiny_protocol), "--json", str(first)) == 0
    )
    session_store = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'fresh.db'}")
    again = workdir / "again.json"
    try:
        assert (
            run_cli(
                "--methods",
                "plain",
                "--protocol",
                str(tiny_protocol),
                "--resume",
                "--json",
                str(again),
            )
            == 0
        )
    finally:  # the harness sets MLflow's process-wide URI: later tests expect the session's store
        mlflow.set_tracking_uri(session_store)
    record = read_records(again)[0]
    assert record["metrics"] == read_records(first)[0]["metrics"]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{workdir / 'fresh.db'}")
    run = client.get_run(record["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert (
        run.data.tags["method"] == "plain" and run.data.tags["fingerprint"] == record["fingerprint"]
    )
    assert run.data.params["protocol.backbone.name"] == "efficientnet_lite0"
    assert run.data.tags["miner"] == "distance_weighted"  # the tiny protocol's, for the margin loss
    history = client.get_metric_history(
        run.info.run_id, metric_key("val", "mean_average_precision_at_r")
    )
    assert [m.step for m in history] == [1, 2]


def test_resume_in_another_experiment_starts_a_run_there(workdir, tiny_protocol):
    """A checkpoint made under experiment A, resumed under B, must not reopen A's run."""
    first, again = workdir / "first.json", workdir / "again.json"
    common = ("--methods", "plain", "--protocol", str(tiny_protocol), "--epochs", "1")
    assert run_cli(*common, "--experiment", "resume-a", "--json", str(first)) == 0
    assert run_cli(*common, "--experiment", "resume-b", "--resume", "--json", str(again)) == 0
    a, b = read_records(first)[0], read_records(again)[0]
    assert b["mlflow_run_id"] != a["mlflow_run_id"] and b["metrics"] == a["metrics"]
    run = mlflow.MlflowClient().get_run(b["mlflow_run_id"])
    assert run.info.experiment_id == mlflow.get_experiment_by_name("resume-b").experiment_id
    assert run.info.status == "FINISHED" and run.data.tags["fingerprint"] == a["fingerprint"]


@pytest.mark.parametrize(
    "method",
    ["plain", pytest.param("avsl", marks=pytest.mark.slow)],  # avsl: 40 s on 2 cores
)
def test_resume_after_sigkill_ends_with_the_uninterrupted_metrics(workdir, tiny_protocol, method):
    """AVSL: its CAM-overlap edges (Eqs. 3-4) are buffers updated by momentum every step,
    so a resumed run matches only if the checkpoint carries them."""
    common = [
        "--methods",
        method,
        "--protocol",
        str(tiny_protocol),
        "--epochs",
        "4",
        "--set",
        "sampling.batches_per_epoch=6",
    ]
    reference = workdir / "reference"
    reference.mkdir()
    proc = _cli_process(reference, *common, "--json", "ref.json")
    assert proc.wait(timeout=600) == 0, proc.stderr.read()

    interrupted = workdir / "interrupted"
    interrupted.mkdir()
    proc = _cli_process(interrupted, *common, "--json", "out.json")
    _wait_for_a_checkpoint(proc, interrupted)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    (checkpoint,) = interrupted.glob("results/checkpoints/*/last.pt")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    epoch = saved["epoch"]
    assert 1 <= epoch < 4, "the kill must land between the first checkpoint and the end"
    if method == "avsl":  # the edges went into the checkpoint, updated once per training step
        assert int(saved["model"]["head.edge_updates"]) == 6 * epoch
        assert any(
            v.abs().sum() > 0 for k, v in saved["model"].items() if k.startswith("head.edges_")
        )
    assert not (interrupted / "out.json").exists()

    proc = _cli_process(interrupted, *common, "--resume", "--json", "out.json")
    assert proc.wait(timeout=600) == 0, proc.stderr.read()
    assert f"after epoch {epoch}" in proc.stderr.read()
    resumed = read_records(interrupted / "out.json")[0]
    expected = read_records(reference / "ref.json")[0]
    assert resumed["metrics"] == expected["metrics"]
    assert resumed["selected_epoch"] == expected["selected_epoch"]
    run = mlflow.MlflowClient().get_run(resumed["mlflow_run_id"])
    assert run.info.status == "FINISHED"


def test_resume_evaluates_a_shared_diml_again_into_its_own_run(workdir, tiny_protocol, capsys):
    """``run --resume`` on finished runs: plain resumes from its last checkpoint, and the
    evaluate-only diml run (no checkpoint of its own) into the same MLflow run, not a new one."""
    out = workdir / "out.json"
    common = (
        "--methods",
        "plain,diml",
        "--protocol",
        str(tiny_protocol),
        "--epochs",
        "1",
        "--resume",
        "--experiment",
        "resume-shared",
        "--json",
        str(out),
    )
    assert run_cli(*common) == 0
    first = {r["method"]: r for r in read_records(out)}
    assert run_cli(*common) == 0
    second = {r["method"]: r for r in read_records(out)}
    assert "evaluating diml seed 0 again into its run" in capsys.readouterr().err
    assert {m: r["mlflow_run_id"] for m, r in first.items()} == {
        m: r["mlflow_run_id"] for m, r in second.items()
    }
    assert first["diml"]["metrics"] == second["diml"]["metrics"]
    experiment = mlflow.get_experiment_by_name("resume-shared").experiment_id
    assert len(mlflow.MlflowClient().search_runs([experiment])) == 2
    assert mlflow.MlflowClient().get_run(second["diml"]["mlflow_run_id"]).info.status == "FINISHED"


def test_a_checkpoint_carries_the_amp_loss_scale(workdir, tiny_protocol):
    """On CUDA the GradScaler's scale and growth counter must survive a resume."""
    from harness.config.protocol_files import load_protocol
    from harness.engine.run.data import prepare_splits
    from harness.engine.run.recorder import NullRecorder
    from harness.engine.run.run_config import RunConfig
    from harness.engine.run.trainer import Trainer

    protocol = load_protocol(tiny_protocol)
    cfg = RunConfig(
        method="plain",
        dataset="synthetic",
        protocol=protocol,
        loss="margin",
        loss_args=protocol.loss_args("margin"),
        seed=0,
    )
    splits = prepare_splits(protocol, "synthetic", None)
    first, second = (
        Trainer.from_config(cfg, splits, recorder=NullRecorder()).parts for _ in range(2)
    )
    first.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    second.scaler = torch.amp.GradScaler("cpu")
    first.scaler.scale(torch.ones(()))  # the scale exists once used
    first.scaler.update(new_scale=256.0)
    second.restore(first.state())
    assert second.scaler.get_scale() == 256.0


def test_a_run_that_finishes_after_a_failure_loses_its_failure_tag(workdir):
    from harness.store.tracking import Tracker

    first = Tracker("failure-tag", "r")
    first.set_tags({"failure": "KeyboardInterrupt: "})
    first.finish("KILLED")
    resumed = Tracker("failure-tag", "r", run_id=first.run_id)
    assert resumed.resumed
    resumed.finish("FINISHED")
    run = mlflow.MlflowClient().get_run(first.run_id)
    assert run.info.status == "FINISHED" and "failure" not in run.data.tags


def _console_script() -> list[str]:
    """What the ``dml-harness`` console script runs, read from pyproject.toml: pip's
    generated script is ``sys.exit(<function>())`` after importing it."""
    import tomllib

    entry = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    module, function = entry["project"]["scripts"]["dml-harness"].split(":")
    return ["-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


def test_the_console_script_installs_the_sigterm_handler(capsys):
    """The console script's function installs SIGTERM's handler, under which SIGTERM unwinds
    like Ctrl-C, and runs the command (``methods``); during a run it is what marks the run
    KILLED (``test_sigterm_marks_the_run_killed``)."""
    import importlib

    module, function = _console_script()[1].split("; ")[1].removeprefix("from ").split(" import ")
    entry = getattr(importlib.import_module(module), function)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert entry(["methods"]) == 0
        handler = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "plain" in capsys.readouterr().out  # the command ran
    assert callable(handler) and handler is not previous
    with pytest.raises(KeyboardInterrupt):  # SIGTERM unwinds like Ctrl-C: the run is marked KILLED
        handler(signal.SIGTERM, None)


@pytest.mark.parametrize(
    "entry", ["python -m harness", pytest.param("dml-harness", marks=pytest.mark.slow)]
)
def test_sigterm_marks_the_run_killed(workdir, tiny_protocol, entry):
    """A sweep stops its workers with SIGTERM; their runs must not stay RUNNING, whichever
    entry point started them."""
    args = (
        "--methods",
        "plain",
        "--protocol",
        str(tiny_protocol),
        "--epochs",
        "4",
        "--set",
        "sampling.batches_per_epoch=6",
    )
    if entry == "python -m harness":
        proc = _cli_process(workdir, *args)
    else:
        proc = subprocess.Popen(
            [sys.executable, *_console_script(), "run", *args],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
    _wait_for_a_checkpoint(proc, workdir)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    (checkpoint,) = workdir.glob("results/checkpoints/*/last.pt")
    run_id = torch.load(checkpoint, map_location="cpu", weights_only=True)["mlflow_run_id"]
    assert mlflow.MlflowClient().get_run(run_id).info.status == "KILLED"
