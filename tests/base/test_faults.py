"""Faults a run must report in one line or survive: a moved tracking store and checkpoint
root (``--init-from`` finds and checks the weights), a tracking failure while failing a
run (the original error wins), non-finite metrics in ``run --json`` (null); and the
MLflow conventions every run follows (source tags, dataset input, weights artifact)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import mlflow
import pytest
from mlflow.exceptions import MlflowException

from harness.base.errors import HarnessError
from harness.cli.main import main
from harness.engine import train_run


def run_cli(*args: str, train=None) -> int:
    """``run`` with ``args``; ``train``: what trains each run (default: the harness's own)."""
    return main(["run", *args], train=train)


def _records(path: Path) -> list[dict]:
    return json.loads(path.read_text())


# --------------------------------------------------- a moved store, MLflow conventions


@pytest.mark.slow  # 35 s on 2 cores: a run, a move, a second run
def test_init_from_after_the_store_and_checkpoints_moved(
    workdir, tiny_protocol, monkeypatch, capsys
):
    """Weights are found relative to the checkpoint root and checked against their sha256;
    the run also carries MLflow's source tags, its dataset input and its weights artifact."""
    session_store = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'mlflow.db'}")
    try:
        plain, diml = workdir / "plain.json", workdir / "diml.json"
        assert (
            run_cli("--methods", "plain", "--protocol", str(tiny_protocol), "--json", str(plain))
            == 0
        )
        trained = _records(plain)[0]
        run = mlflow.MlflowClient().get_run(trained["mlflow_run_id"])
        tags = run.data.tags
        assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.source.name"]
        assert tags["git_commit"].startswith(tags.get("mlflow.source.git.commit", "unknown"))
        (dataset,) = run.inputs.dataset_inputs
        assert (
            dataset.dataset.name == "synthetic" and dataset.dataset.digest == tags["split_digest"]
        )
        weights = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "weights")}
        assert weights == {"weights/model.pt"}
        # recorded relative to the checkpoint root, as is the run's checkpoint folder
        assert tags["model_path"] == f"{tags['checkpoint_dir']}/model.pt"
        model_file = workdir / "results" / "checkpoints" / tags["model_path"]
        assert tags["model_sha256"] == hashlib.sha256(model_file.read_bytes()).hexdigest()

        moved = workdir / "elsewhere"
        moved.mkdir()
        shutil.move(workdir / "mlflow.db", moved / "mlflow.db")
        shutil.move(workdir / "results" / "checkpoints", moved / "checkpoints")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{moved / 'mlflow.db'}")
        monkeypatch.setenv("DML_HARNESS_CHECKPOINTS", str(moved / "checkpoints"))
        assert (
            run_cli(
                "--methods",
                "diml",
                "--protocol",
                str(tiny_protocol),
                "--evaluate-only",
                "--init-from",
                trained["mlflow_run_id"],
                "--json",
                str(diml),
            )
            == 0
        )
        metrics = _records(diml)[0]["metrics"]
        for name, value in trained["metrics"].items():
            assert metrics[f"global_{name}"] == pytest.approx(value, abs=1e-12)

        moved_file = moved / "checkpoints" / tags["model_path"]
        data = bytearray(moved_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        moved_file.write_bytes(bytes(data))
        capsys.readouterr()
        monkeypatch.delenv("DML_HARNESS_CHECKPOINTS")
        assert (
            run_cli(
                "--methods",
                "diml",
                "--protocol",
                str(tiny_protocol),
                "--evaluate-only",
                "--init-from",
                trained["mlflow_run_id"],
                "--checkpoint-root",
                str(moved / "checkpoints"),
                "--json",
                str(workdir / "bad.json"),
            )
            == 2
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(
            f"error: --init-from: {moved_file} does not match the weights recorded"
        )
        assert "Traceback" not in "\n".join(err) and not (workdir / "bad.json").exists()
    finally:  # the harness sets MLflow's process-wide URI: later tests expect the session's store
        mlflow.set_tracking_uri(session_store)


def test_a_tracking_failure_while_failing_a_run_keeps_the_original_error(
    workdir, tiny_protocol, monkeypatch, capsys
):

    def original(*args, **kwargs):
        raise HarnessError("the original failure")

    experiment = "store-down-while-failing"
    real_set_terminated = mlflow.MlflowClient.set_terminated

    def store_down(client, run_id, status=None, end_time=None):
        """The store fails when this test's run is marked FAILED (other runs end as usual)."""
        run = client.get_run(run_id)
        if status == "FAILED" and client.get_experiment(run.info.experiment_id).name == experiment:
            raise MlflowException("(sqlite3.OperationalError) disk I/O error\nsecond line")
        return real_set_terminated(client, run_id, status, end_time)

    monkeypatch.setattr(mlflow.MlflowClient, "set_terminated", store_down)
    failing = functools.partial(train_run, evaluator=original)
    argv = ("--methods", "plain", "--protocol", str(tiny_protocol), "--epochs", "0")
    assert run_cli(*argv, "--experiment", experiment, train=failing) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: the original failure"
    (logged,) = [line for line in err if line.startswith("could not mark run")]
    assert "FAILED" in logged and "disk I/O error" in logged and "second line" not in logged


# ------------------------------------------------------------------ --json, non-finite


def test_run_json_writes_null_for_non_finite_metrics(workdir, tiny_protocol):
    def scores(*args, metrics=None, **kwargs):
        return {"precision_at_1": math.nan, "r_precision": 0.25, "recall_at_1": math.inf}

    out = workdir / "nan.json"
    assert (
        run_cli(
            "--methods",
            "plain",
            "--protocol",
            str(tiny_protocol),
            "--epochs",
            "0",
            "--json",
            str(out),
            train=functools.partial(train_run, evaluator=scores),
        )
        == 0
    )

    def refuse(token):
        raise AssertionError(f"{token} is not JSON")

    metrics = json.loads(out.read_text(), parse_constant=refuse)[0]["metrics"]
    assert metrics == {"precision_at_1": None, "r_precision": 0.25, "recall_at_1": None}
