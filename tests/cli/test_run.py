"""End-to-end ``python -m harness run`` on the embedded dataset with a tiny protocol:
records, MLflow, determinism, ``--epochs 0``, ``--init-from`` and ``--evaluate-only``, and
the commit a run records (resuming and interrupting runs: ``test_run_resume.py``)."""

from __future__ import annotations

import subprocess

import mlflow
import pytest
import torch

from harness.base.metric_keys import metric_key
from harness.cli.main import main
from tests.cli_runs import read_records, run_cli


def test_run_writes_records_and_a_finished_mlflow_run(workdir, tiny_protocol, capsys):
    out = workdir / "out.json"
    # The methods whose records this test reads (`--methods all` runs in the slow
    # end-to-end tests and the README's command).
    methods = "avsl,diml,plain,sam"
    assert run_cli("--methods", methods, "--protocol", str(tiny_protocol), "--json", str(out)) == 0
    records = read_records(out)
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
    assert tags["model_uri"] == "none (DML_HARNESS_LOG_MODEL=0)"  # the suite's setting
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
    assert read_records(a)[0]["metrics"] == read_records(b)[0]["metrics"]
    assert read_records(a)[0]["fingerprint"] == read_records(b)[0]["fingerprint"]


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
    rec = read_records(out)[0]
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
    rec = read_records(control)[0]
    assert "splits.train: 'training classes' -> 'seen-class control'" in rec["deviations"]
    assert rec["fingerprint"] != read_records(real)[0]["fingerprint"]
    tags = mlflow.MlflowClient().get_run(rec["mlflow_run_id"]).data.tags
    assert "seen-class control" in tags["deviations"]


def test_shuffled_labels_control_is_a_deviation_and_its_run_explains(
    workdir, tiny_protocol, capsys
):
    out = workdir / "shuffled.json"
    common = ("--methods", "plain", "--protocol", str(tiny_protocol), "--epochs", "1")
    assert run_cli(*common, "--shuffled-labels-control", "--json", str(out)) == 0
    rec = read_records(out)[0]
    assert "splits.train: 'training labels' -> 'shuffled-labels control'" in rec["deviations"]
    # explain rebuilds the run's own (shuffled) splits: their digest matches the recorded one
    args = ["explain", "--run", rec["mlflow_run_id"], "--pairs", "4", "--curve-pairs", "1"]
    assert main([*args, "--out", str(workdir / "explained")]) == 0
    capsys.readouterr()
    both = ("--seen-class-control", "--shuffled-labels-control")
    assert run_cli(*common, *both) == 2
    assert "two controls: give one" in capsys.readouterr().err


def test_a_method_revision_from_two_on_changes_the_checkpoint_key(tiny_protocol):
    from harness.config.protocol_files import load_protocol
    from harness.engine.run.run_config import RunConfig, run_key
    from tests.revisions import PLAIN_TEST, RevisedPlainHead, plain_test

    cfg = RunConfig(
        method=PLAIN_TEST,
        dataset="synthetic",
        protocol=load_protocol(tiny_protocol),
        loss="margin",
        loss_args={},
        seed=0,
    )
    with plain_test():
        before = run_key(cfg, "fp")
    with plain_test(RevisedPlainHead):
        after = run_key(cfg, "fp")
    assert after != before  # a resume never continues the older code's checkpoint


def test_evaluate_only_reproduces_the_init_from_runs_test_metrics(workdir, tiny_protocol, capsys):
    first, second = workdir / "first.json", workdir / "second.json"
    common = ("--methods", "plain", "--protocol", str(tiny_protocol))
    assert run_cli(*common, "--json", str(first)) == 0
    trained = read_records(first)[0]
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
    again = read_records(second)[0]
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
    one_epoch = read_records(first)[0]
    assert run_cli(*common, "--init-from", one_epoch["mlflow_run_id"], "--json", str(tuned)) == 0
    assert (
        f"init_from: \"the protocol's pretrained weights\" -> '{one_epoch['mlflow_run_id']}'"
        in read_records(tuned)[0]["deviations"]
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
    rec = read_records(out)[0]
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
    trained = read_records(plain)[0]
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
    metrics = read_records(diml)[0]["metrics"]
    for name, value in trained["metrics"].items():
        assert metrics[f"global_{name}"] == pytest.approx(value, abs=1e-12)
    assert 0.0 <= metrics["precision_at_1"] <= 1.0


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


def test_a_run_stores_its_per_query_results_and_evaluation_code(workdir, tiny_protocol):
    from harness.components.evaluation import (
        PER_QUERY_ARTIFACT,
        evaluation_code_digest,
        per_query_values,
    )
    from harness.reports.tables import artifact_per_query

    out = workdir / "out.json"
    assert run_cli("--methods", "plain", "--protocol", str(tiny_protocol), "--json", str(out)) == 0
    rec = read_records(out)[0]
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
    from harness.cli.run_command import shared_training
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
