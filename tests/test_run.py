"""End-to-end ``python -m harness run`` on the embedded dataset with a tiny protocol:
records, MLflow, determinism, resume after SIGKILL, ``--epochs 0``."""

from __future__ import annotations

import json
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
from harness.cli.main import main


def run_cli(*args: str) -> int:
    return main(["run", *args])


def _records(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def test_run_writes_records_and_a_finished_mlflow_run(workdir, tiny_protocol, capsys):
    out = workdir / "out.json"
    assert run_cli("--methods", "all", "--protocol", str(tiny_protocol), "--json", str(out)) == 0
    records = _records(out)
    assert {r["method"] for r in records} >= {"plain"}
    rec = next(r for r in records if r["method"] == "plain")
    assert set(rec) >= {"method", "dataset", "loss", "seed", "protocol", "fingerprint", "metrics"}
    assert rec["dataset"] == "synthetic" and rec["loss"] == "margin" and rec["seed"] == 0
    for name in (
        "precision_at_1",
        "r_precision",
        "mean_average_precision_at_r",
        "recall_at_1",
        "recall_at_8",
    ):
        assert 0.0 <= rec["metrics"][name] <= 1.0
    printed, printed_err = capsys.readouterr()
    assert "MAP@R" in printed and "plain" in printed and rec["fingerprint"] in printed

    run = mlflow.MlflowClient().get_run(rec["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    tags, params = run.data.tags, run.data.params
    assert tags["fingerprint"] == rec["fingerprint"] and tags["seed"] == "0"
    assert tags["git_commit"] and tags["torch_build"] == torch.__version__
    assert tags["torch_threads"] == str(
        torch.get_num_threads()
    )  # a bit-exact rerun needs the same count
    assert tags["version.pytorch-metric-learning"] != "not installed"
    assert tags["deviations"] == "none" and tags["test_set_selection"] == "False"
    assert params["protocol.backbone.name"] == "efficientnet_lite0"
    assert params["protocol.sampling.classes_per_batch"] == "8"
    history = mlflow.MlflowClient().get_metric_history(
        run.info.run_id, metric_key("val", "mean_average_precision_at_r")
    )
    assert [m.step for m in history] == [1, 2]  # one validation per epoch
    assert run.data.metrics[metric_key("test", "precision_at_1")] == pytest.approx(
        rec["metrics"]["precision_at_1"]
    )
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "protocol")}
    assert {"protocol/tiny.toml", "protocol/resolved.json", "protocol/deviations.json"} <= artifacts
    # Explanations logged with the run: SAM's Fig. 4 (a test triplet, maps as data) and pair
    # figure; AVSL's Figs. 6-7 and the pair's Eq. 11 attribution as data.
    logged = {
        r["method"]: {
            a.path for a in mlflow.MlflowClient().list_artifacts(r["mlflow_run_id"], "explanations")
        }
        for r in records
    }
    assert {
        "explanations/triplet.png",
        "explanations/triplet.npz",
        "explanations/pair.png",
    } <= logged["sam"]
    assert {
        "explanations/pair_fig6.png",
        "explanations/pair_fig7.png",
        "explanations/pair_avsl_attribution.json",
    } <= logged["avsl"]
    # Training-free DIML is evaluated on plain's weights, not trained a second time, and
    # the records keep the asked (alphabetical) order.
    assert [r["method"] for r in records] == sorted(r["method"] for r in records)
    diml_record = next(r for r in records if r["method"] == "diml")
    diml = mlflow.MlflowClient().get_run(diml_record["mlflow_run_id"])
    assert (
        diml.data.tags["init_from"] == rec["mlflow_run_id"]
        and diml.data.tags["evaluate_only"] == "True"
    )
    assert diml.data.tags["deviations"] == "none"
    for name, value in rec["metrics"].items():
        assert diml_record["metrics"][f"global_{name}"] == pytest.approx(value, abs=1e-12)
    assert "diml: evaluated on plain's trained weights" in printed_err


def test_same_seed_twice_gives_identical_metrics(workdir, tiny_protocol):
    a, b = workdir / "a.json", workdir / "b.json"
    assert run_cli("--methods", "plain", "--protocol", str(tiny_protocol), "--json", str(a)) == 0
    assert run_cli("--methods", "plain", "--protocol", str(tiny_protocol), "--json", str(b)) == 0
    assert _records(a)[0]["metrics"] == _records(b)[0]["metrics"]
    assert _records(a)[0]["fingerprint"] == _records(b)[0]["fingerprint"]


def test_epochs_zero_evaluates_the_initial_model_as_a_deviation(workdir, tiny_protocol):
    out = workdir / "zero.json"
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
        )
        == 0
    )
    rec = _records(out)[0]
    assert rec["selected_epoch"] == 0
    assert rec["deviations"] == ["schedule.epochs: 2 -> 0"]
    assert (
        mlflow.MlflowClient().get_run(rec["mlflow_run_id"]).data.tags["deviations"]
        == "schedule.epochs: 2 -> 0"
    )


def test_seen_class_control_is_a_deviation_with_its_own_fingerprint(workdir, tiny_protocol, capsys):
    real, control = workdir / "real.json", workdir / "control.json"
    common = ("--methods", "plain", "--protocol", str(tiny_protocol), "--epochs", "1")
    assert run_cli(*common, "--json", str(real)) == 0
    assert run_cli(*common, "--seen-class-control", "--json", str(control)) == 0
    rec = _records(control)[0]
    assert "splits.train: 'training classes' -> 'seen-class control'" in rec["deviations"]
    assert rec["fingerprint"] != _records(real)[0]["fingerprint"]
    tags = mlflow.MlflowClient().get_run(rec["mlflow_run_id"]).data.tags
    assert "seen-class control" in tags["deviations"]


def test_a_method_revision_from_two_on_changes_the_checkpoint_key(tiny_protocol, monkeypatch):
    from harness.config.protocol_files import load_protocol
    from harness.engine.training import RunConfig, run_key
    from harness.methods.plain import PlainHead

    cfg = RunConfig(
        method="plain",
        dataset="synthetic",
        protocol=load_protocol(tiny_protocol),
        loss="margin",
        loss_args={},
        seed=0,
    )
    before = run_key(cfg, "fp")
    monkeypatch.setattr(PlainHead, "revision", 2)
    assert run_key(cfg, "fp") != before  # a resume never continues the older code's checkpoint


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
    record = _records(again)[0]
    assert record["metrics"] == _records(first)[0]["metrics"]
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
    a, b = _records(first)[0], _records(again)[0]
    assert b["mlflow_run_id"] != a["mlflow_run_id"] and b["metrics"] == a["metrics"]
    run = mlflow.MlflowClient().get_run(b["mlflow_run_id"])
    assert run.info.experiment_id == mlflow.get_experiment_by_name("resume-b").experiment_id
    assert run.info.status == "FINISHED" and run.data.tags["fingerprint"] == a["fingerprint"]


@pytest.mark.parametrize("method", ["plain", "avsl"])
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
    resumed = _records(interrupted / "out.json")[0]
    expected = _records(reference / "ref.json")[0]
    assert resumed["metrics"] == expected["metrics"]
    assert resumed["selected_epoch"] == expected["selected_epoch"]
    run = mlflow.MlflowClient().get_run(resumed["mlflow_run_id"])
    assert run.info.status == "FINISHED"


def test_evaluate_only_reproduces_the_init_from_runs_test_metrics(workdir, tiny_protocol, capsys):
    first, second = workdir / "first.json", workdir / "second.json"
    common = ("--methods", "plain", "--protocol", str(tiny_protocol))
    assert run_cli(*common, "--json", str(first)) == 0
    trained = _records(first)[0]
    assert (
        run_cli(
            *common,
            "--evaluate-only",
            "--init-from",
            trained["mlflow_run_id"],
            "--json",
            str(second),
        )
        == 0
    )
    again = _records(second)[0]
    assert again["metrics"] == trained["metrics"]
    assert again["deviations"] == [] and again["fingerprint"] == trained["fingerprint"]
    assert (
        mlflow.MlflowClient().get_run(again["mlflow_run_id"]).data.tags["init_from"]
        == trained["mlflow_run_id"]
    )

    capsys.readouterr()
    assert run_cli(*common, "--evaluate-only", "--init-from", "no-such-run") == 2
    assert "error: --init-from: no run 'no-such-run'" in capsys.readouterr().err
    assert run_cli(*common, "--evaluate-only") == 2
    assert "give --init-from RUN_ID" in capsys.readouterr().err


def test_init_from_with_training_is_a_deviation_and_evaluate_only_needs_the_same_protocol(
    workdir, tiny_protocol, capsys
):
    first, tuned = workdir / "first.json", workdir / "tuned.json"
    common = ("--methods", "plain", "--protocol", str(tiny_protocol))
    assert run_cli(*common, "--epochs", "1", "--json", str(first)) == 0
    one_epoch = _records(first)[0]
    assert run_cli(*common, "--init-from", one_epoch["mlflow_run_id"], "--json", str(tuned)) == 0
    assert (
        f"init_from: \"the protocol's pretrained weights\" -> '{one_epoch['mlflow_run_id']}'"
        in _records(tuned)[0]["deviations"]
    )
    capsys.readouterr()
    # Trained for 1 epoch (a deviation), so not under the protocol this run evaluates with.
    assert run_cli(*common, "--evaluate-only", "--init-from", one_epoch["mlflow_run_id"]) == 2
    assert "was trained under protocol fingerprint" in capsys.readouterr().err


def test_test_set_selection_is_labelled_everywhere(workdir, tiny_protocol, capsys):
    out = workdir / "paper.json"
    assert (
        run_cli(
            "--methods",
            "plain",
            "--protocol",
            str(tiny_protocol),
            "--epochs",
            "1",
            "--set",
            "selection.mode=test-paper",
            "--json",
            str(out),
        )
        == 0
    )
    rec = _records(out)[0]
    assert rec["selection"] == "test-paper"
    assert "TEST-SET SELECTION" in capsys.readouterr().out
    tags = mlflow.MlflowClient().get_run(rec["mlflow_run_id"]).data.tags
    assert tags["test_set_selection"] == "True" and "selection.mode" in tags["deviations"]


def test_diml_at_test_time_on_a_finished_plain_run(workdir, tiny_protocol):
    """The paper's training-free use: DIML re-ranks the cosine ranking of a trained model.
    Its ``global_*`` metrics are that model's own cosine metrics."""
    plain, diml = workdir / "plain.json", workdir / "diml.json"
    assert (
        run_cli("--methods", "plain", "--protocol", str(tiny_protocol), "--json", str(plain)) == 0
    )
    trained = _records(plain)[0]
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
    assert 0.0 <= metrics["precision_at_1"] <= 1.0


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
    first = {r["method"]: r for r in _records(out)}
    assert run_cli(*common) == 0
    second = {r["method"]: r for r in _records(out)}
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
    from harness.engine.recorder import NullRecorder
    from harness.engine.trainer import Trainer
    from harness.engine.training import RunConfig, prepare_splits

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
    first, second = (Trainer.build(cfg, splits, recorder=NullRecorder()).parts for _ in range(2))
    first.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    second.scaler = torch.amp.GradScaler("cpu")
    first.scaler.scale(torch.ones(()))  # the scale exists once used
    first.scaler.update(new_scale=256.0)
    second.restore(first.state())
    assert second.scaler.get_scale() == 256.0


def test_the_recorded_commit_is_dirty_with_a_new_uncommitted_source_file(tmp_path):
    from harness.store.provenance import git_commit

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )

    git("init", "-q")
    (tmp_path / "harness" / "methods").mkdir(parents=True)
    (tmp_path / "harness" / "methods" / "plain.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-qm", "init")
    assert not git_commit(tmp_path).endswith("-dirty")
    (tmp_path / "notes.txt").write_text("outputs and notes do not count\n")
    assert not git_commit(tmp_path).endswith("-dirty")
    (tmp_path / "harness" / "methods" / "new_method.py").write_text("y = 2\n")
    assert git_commit(tmp_path).endswith("-dirty")


def test_the_uncommitted_patch_turns_the_commit_into_the_code_that_ran(tmp_path):
    from harness.store.provenance import uncommitted_changes

    repo, clone = tmp_path / "repo", tmp_path / "clone"
    repo.mkdir()
    git = lambda *args, cwd=repo: subprocess.run(  # noqa: E731
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )
    git("init", "-q")
    (repo / "harness" / "methods").mkdir(parents=True)
    (repo / "harness" / "methods" / "plain.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-qm", "init")
    (repo / "harness" / "methods" / "plain.py").write_text("x = 3\n")
    (repo / "harness" / "methods" / "new_method.py").write_text("y = 2\n")
    (repo / "scratch.txt").write_text("not source\n")
    patch = tmp_path / "uncommitted.patch"
    patch.write_text(uncommitted_changes(repo))
    git("clone", "-q", str(repo), str(clone), cwd=tmp_path)
    git("apply", str(patch), cwd=clone)
    assert (clone / "harness" / "methods" / "plain.py").read_text() == "x = 3\n"
    assert (clone / "harness" / "methods" / "new_method.py").read_text() == "y = 2\n"
    assert not (clone / "scratch.txt").exists()


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

    entry = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    module, function = entry["project"]["scripts"]["dml-harness"].split(":")
    return ["-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


def test_the_console_script_installs_the_sigterm_handler(monkeypatch):
    import importlib

    import harness.cli.main as cli

    module, function = _console_script()[1].split("; ")[1].removeprefix("from ").split(" import ")
    entry = getattr(importlib.import_module(module), function)
    seen = {}

    def fake_main(argv=None):
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        return 0

    monkeypatch.setattr(cli, "main", fake_main)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert entry([]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    with pytest.raises(KeyboardInterrupt):  # SIGTERM unwinds like Ctrl-C: the run is marked KILLED
        seen["handler"](signal.SIGTERM, None)


@pytest.mark.parametrize("entry", ["python -m harness", "dml-harness"])
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


def test_a_run_stores_its_per_query_results_and_evaluation_code(workdir, tiny_protocol):
    from harness.components.evaluation import (
        PER_QUERY_ARTIFACT,
        evaluation_code_digest,
        per_query_values,
    )
    from harness.reports.tables import artifact_per_query

    out = workdir / "out.json"
    assert run_cli("--methods", "plain", "--protocol", str(tiny_protocol), "--json", str(out)) == 0
    rec = _records(out)[0]
    run = mlflow.MlflowClient().get_run(rec["mlflow_run_id"])
    assert run.data.tags["evaluation_code"] == evaluation_code_digest()
    assert PER_QUERY_ARTIFACT in {
        a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "evaluation")
    }
    arrays = artifact_per_query(run.info.run_id)
    for metric in (
        "precision_at_1",
        "r_precision",
        "mean_average_precision_at_r",
        "r_precision_query_in_r",
    ):
        assert per_query_values(arrays, metric).mean() == pytest.approx(
            run.data.metrics[metric_key("test", metric)]
        ), metric
    # DIML's variant rides along in the store, not in the run's printed record
    assert "mean_average_precision_at_r_query_in_r" in rec["metrics"]


def test_run_shares_training_only_where_a_method_trains_as_another_in_the_same_run(
    tiny_protocol, monkeypatch
):
    from harness.cli.run import shared_training
    from harness.config.protocol import apply_overrides
    from harness.config.protocol_files import load_protocol

    protocol = load_protocol(tiny_protocol)
    assert shared_training(["plain", "diml", "diml_train", "diml_ss", "sam"], protocol) == {
        "diml": "plain",
        "diml_ss": "plain",
    }  # diml_train trains its own way (App. A.3)
    assert shared_training(["diml", "sam"], protocol) == {}  # no plain to train
    max_pool, _ = apply_overrides(protocol, ["methods.plain.pool=max"])
    assert shared_training(["plain", "diml"], max_pool) == {}  # plain trains another head
    structural, _ = apply_overrides(protocol, ["methods.diml.train_structural=true"])
    assert shared_training(["plain", "diml"], structural) == {}
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: every process trains every run
    assert shared_training(["plain", "diml"], protocol) == {}
