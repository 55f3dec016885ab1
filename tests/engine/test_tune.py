"""``tune``: seeded TPE over a plugin's search space and protocol learning rates, scored
on validation MAP@R, resumable without repeating finished trials, the best setting
reproduced over the protocol's seeds; every run linked to the study in MLflow."""

from __future__ import annotations

import argparse
import os
import uuid

import mlflow
import optuna
import pytest

from harness.base.errors import HarnessError
from harness.base.metric_keys import metric_key
from harness.cli.parsers.tune import add_tune_parser
from harness.config.protocol_files import load_protocol
from harness.engine.tuning.tune import study_name, suggest


def _tune(*argv: str, train=None) -> int:
    """``tune`` with ``argv`` in this process; ``train``: what trains each run."""
    parser = argparse.ArgumentParser()
    add_tune_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tune", *argv])
    return args.func(args, train=train)


def _runs(experiment: str) -> list:
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name(experiment)
    return [] if exp is None else mlflow.MlflowClient().search_runs([exp.experiment_id])


def test_search_space_includes_the_plugin_and_protocol_fields(tiny_protocol):
    protocol = load_protocol(tiny_protocol)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    trial = study.ask()
    options, overrides = suggest(trial, "agrouping", protocol, ("optimizer.lr_head",))
    assert set(options) == {"groups", "diversity_weight"} and 16 % options["groups"] == 0
    assert set(overrides) == {"optimizer.lr_head"}
    assert 1e-4 <= overrides["optimizer.lr_head"] <= 1e-2  # the tiny protocol's 1e-3 / 10 .. * 10
    with pytest.raises(HarnessError, match="only positive float fields"):
        suggest(study.ask(), "plain", protocol, ("schedule.epochs",))


def test_tuning_refuses_test_set_selection(workdir, tiny_protocol):
    with pytest.raises(HarnessError, match="never chosen on the test set"):
        _tune(
            "--method",
            "plain",
            "--trials",
            "1",
            "--protocol",
            str(tiny_protocol),
            "--set",
            'selection.mode="test-paper"',
        )


def _fake_training(calls: list):
    """Stands in for ``run_training``: an MLflow run with a validation history, no training."""
    from harness.store.tracking import Tracker

    def run(cfg, splits=None, on_epoch=None):
        calls.append(cfg)
        tracker = Tracker(cfg.experiment, f"{cfg.method}-fake")
        lr = cfg.protocol.optimizer.lr_head
        tracker.set_tags(
            {
                "method": cfg.method,
                "seed": cfg.seed,
                "protocol": cfg.protocol.name,
                "fingerprint": "fake",
                "selection": "validation",
                "deviations": "; ".join(map(str, cfg.deviations)) or "none",
            }
        )
        for epoch, value in ((1, lr * 10), (2, lr * 20)):
            tracker.log_metrics(
                {metric_key("val", "mean_average_precision_at_r"): value}, step=epoch
            )
            if on_epoch is not None:  # as run_training does after each epoch
                on_epoch(epoch, {metric_key("val", "mean_average_precision_at_r"): value})
        tracker.log_metrics({metric_key("test", "mean_average_precision_at_r"): lr}, step=2)
        tracker.finish()
        return {
            "method": cfg.method,
            "dataset": cfg.dataset,
            "loss": cfg.loss,
            "seed": cfg.seed,
            "protocol": cfg.protocol.name,
            "fingerprint": "fake",
            "deviations": [],
            "selection": "validation",
            "mlflow_run_id": tracker.run_id,
            "metrics": {"mean_average_precision_at_r": lr},
        }

    return run


def test_tune_resume_logic_without_training(workdir, tiny_protocol, capsys):
    calls: list = []
    fake = _fake_training(calls)
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    experiment = f"tune-fake-{uuid.uuid4().hex[:6]}"
    common = [
        "--method",
        "agrouping",
        "--protocol",
        str(tiny_protocol),
        "--storage",
        storage,
        "--experiment",
        experiment,
        "--space",
        "optimizer.lr_head",
    ]
    assert _tune(*common, "--trials", "3", "--no-reproduce", train=fake) == 0
    assert len(calls) == 3
    name = study_name(
        "agrouping", "synthetic", "margin", load_protocol(tiny_protocol), ("optimizer.lr_head",)
    )
    study = optuna.load_study(study_name=name, storage=storage)
    best = study.best_trial
    assert best.value == pytest.approx(
        best.params["optimizer.lr_head"] * 20
    )  # best epoch of the history
    assert best.intermediate_values == pytest.approx({1: best.value / 2, 2: best.value})
    assert _tune(*common, "--trials", "3", "--no-reproduce", train=fake) == 0
    assert len(calls) == 3  # nothing repeated
    assert _tune(*common, "--trials", "5", "--seeds", "0,1", train=fake) == 0
    assert len(calls) == 5 + 2  # two more trials, then the best over two seeds
    repro = calls[-2:]
    best = optuna.load_study(study_name=name, storage=storage).best_trial
    assert [c.seed for c in repro] == [0, 1]
    assert repro[0].protocol.optimizer.lr_head == pytest.approx(best.params["optimizer.lr_head"])
    # The loss's arguments are searched too (LOSS_SEARCH_SPACES), as protocol fields.
    assert repro[0].method_options == {
        k: v
        for k, v in best.params.items()
        if k != "optimizer.lr_head" and not k.startswith("loss.args.")
    }
    assert repro[0].loss_args["margin"] == pytest.approx(best.params["loss.args.margin.margin"])
    assert repro[0].loss_args["beta"] == pytest.approx(best.params["loss.args.margin.beta"])
    assert _tune(*common, "--trials", "5", "--seeds", "0,1", train=fake) == 0
    assert len(calls) == 7  # reproductions found in MLflow, not repeated
    assert "over seeds [0, 1]" in capsys.readouterr().out


@pytest.mark.slow
def test_tune_resumes_without_repeating_trials_and_reproduces_the_best(
    workdir, tiny_protocol, capsys
):
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    experiment = f"tune-{uuid.uuid4().hex[:6]}"
    common = [
        "--method",
        "agrouping",
        "--protocol",
        str(tiny_protocol),
        "--storage",
        storage,
        "--experiment",
        experiment,
        "--space",
        "optimizer.lr_head",
    ]
    assert _tune(*common, "--trials", "2", "--no-reproduce") == 0
    name = study_name(
        "agrouping", "synthetic", "margin", load_protocol(tiny_protocol), ("optimizer.lr_head",)
    )
    study = optuna.load_study(study_name=name, storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    runs = _runs(experiment)
    assert len(runs) == 2
    for run in runs:
        tags = run.data.tags
        assert tags["optuna_study"] == name and tags["tune_role"] == "trial"
        assert tags["deviations"].startswith("optimizer.lr_head: 0.001 ->")  # a recorded deviation
        trial = study.trials[int(tags["optuna_trial"])]
        assert trial.user_attrs["mlflow_run_id"] == run.info.run_id
        assert trial.value == pytest.approx(max(trial.intermediate_values.values()))
        assert run.data.params["method.groups"] == str(trial.params["groups"])

    # Re-running with the same target repeats nothing; reproduction of the best (seed 0) only.
    assert _tune(*common, "--trials", "2") == 0
    study = optuna.load_study(study_name=name, storage=storage)
    assert len(study.trials) == 2
    runs = _runs(experiment)
    repro = [r for r in runs if r.data.tags["tune_role"] == "reproduction"]
    assert len(runs) == 3 and len(repro) == 1
    assert repro[0].data.tags["optuna_trial"] == str(study.best_trial.number)
    assert metric_key("test", "mean_average_precision_at_r") in repro[0].data.metrics
    out = capsys.readouterr().out
    assert f"best trial {study.best_trial.number}" in out and "over seeds [0]" in out

    # A larger target runs only the difference; the finished reproduction is not repeated.
    assert _tune(*common, "--trials", "3") == 0
    study = optuna.load_study(study_name=name, storage=storage)
    assert len(study.trials) == 3
    runs = _runs(experiment)
    expected_repro = 1 if study.best_trial.number != 2 else 2
    assert len([r for r in runs if r.data.tags["tune_role"] == "reproduction"]) == expected_repro
    assert len(runs) == 3 + 1 + (expected_repro - 1)


def test_bad_seeds_are_one_line_before_any_trial(workdir, tiny_protocol, capsys):
    from harness.cli.main import main

    calls: list = []

    assert (
        main(
            [
                "tune",
                "--method",
                "plain",
                "--protocol",
                str(tiny_protocol),
                "--storage",
                f"sqlite:///{workdir / 'optuna.db'}",
                "--trials",
                "1",
                "--seeds",
                "0,x",
            ],
            train=_fake_training(calls),
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "error: tune: argument --seeds: expected comma-separated integers >= 0 like 0,1,2, got '0,x'"
        in err
    )
    assert "Traceback" not in err and calls == []


def test_a_quote_in_the_protocol_name_does_not_break_the_reproduction_lookup(
    workdir, tiny_protocol
):
    """The study name holds the protocol's name; tune finds its finished reproductions with
    an MLflow filter on it, which interpolating the name between quotes broke."""
    quoted = workdir / "o'brien.toml"
    quoted.write_text(tiny_protocol.read_text())
    calls: list = []
    fake = _fake_training(calls)
    common = [
        "--method",
        "plain",
        "--protocol",
        str(quoted),
        "--storage",
        f"sqlite:///{workdir / 'optuna.db'}",
        "--experiment",
        f"tune-quote-{uuid.uuid4().hex[:6]}",
        "--space",
        "optimizer.lr_head",
        "--trials",
        "1",
        "--seeds",
        "0",
    ]
    assert _tune(*common, train=fake) == 0
    assert len(calls) == 2 and "o'brien" in calls[-1].tags["optuna_study"]
    assert _tune(*common, train=fake) == 0
    assert len(calls) == 2  # the reproduction was found through the quoted filter, not run again


def test_a_restarted_study_suggests_what_an_uninterrupted_one_does(workdir, tiny_protocol):
    """A trial interrupted (SIGTERM) is run again with its parameters and the next trials
    get the suggestions of an uninterrupted study: the sampler is seeded per trial."""

    def study_params(storage: str, interrupt_at: int | None) -> list[float]:
        calls: list = []
        fake = _fake_training(calls)

        def run(cfg, splits=None, on_epoch=None):
            if len(calls) == interrupt_at:
                calls.append(cfg)
                raise KeyboardInterrupt
            return fake(cfg, splits, on_epoch)

        common = [
            "--method",
            "plain",
            "--protocol",
            str(tiny_protocol),
            "--storage",
            storage,
            "--experiment",
            f"tune-restart-{uuid.uuid4().hex[:6]}",
            "--space",
            "optimizer.lr_head",
            "--trials",
            "3",
            "--no-reproduce",
        ]
        if interrupt_at is not None:
            with pytest.raises(KeyboardInterrupt):
                _tune(*common, train=run)
        assert _tune(*common, train=run) == 0
        name = study_name(
            "plain", "synthetic", "margin", load_protocol(tiny_protocol), ("optimizer.lr_head",)
        )
        study = optuna.load_study(study_name=name, storage=storage)
        done = [t for t in study.trials if t.state.name == "COMPLETE"]
        assert len(done) == 3
        return [t.params["optimizer.lr_head"] for t in done]

    uninterrupted = study_params(f"sqlite:///{workdir / 'a.db'}", None)
    assert study_params(f"sqlite:///{workdir / 'b.db'}", 1) == uninterrupted


@pytest.mark.slow
def test_tune_with_folds_scores_the_mean_over_class_disjoint_folds_without_the_test_split(
    workdir, tiny_protocol
):
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    experiment = f"tune-folds-{uuid.uuid4().hex[:6]}"
    argv = ["--method", "plain", "--protocol", str(tiny_protocol), "--storage", storage]
    argv += ["--experiment", experiment, "--folds", "2", "--trials", "1", "--no-reproduce"]
    assert _tune(*argv) == 0
    runs = _runs(experiment)
    assert sorted(r.data.tags["tune_fold"] for r in runs) == ["0", "1"]
    assert not any(k.startswith("test/") for r in runs for k in r.data.metrics)
    best = [
        max(v.value for v in mlflow.MlflowClient().get_metric_history(r.info.run_id, key))
        for r in runs
        for key in [metric_key("val", "mean_average_precision_at_r")]
    ]
    name = study_name(
        "plain",
        "synthetic",
        "margin",
        load_protocol(tiny_protocol),
        ("optimizer.lr_head", "optimizer.lr_backbone"),
        folds=2,
    )
    trial = optuna.load_study(study_name=name, storage=storage).best_trial
    assert trial.value == pytest.approx(sum(best) / 2)
    assert {"loss.args.margin.margin", "loss.args.margin.beta"} <= set(trial.params)


def test_tune_refuses_more_folds_than_the_training_classes_allow(workdir, tiny_protocol):
    with pytest.raises(HarnessError, match="folds = 500 needs at least 1000 training classes"):
        _tune(
            "--method", "plain", "--protocol", str(tiny_protocol), "--folds", "500", "--trials", "1"
        )
