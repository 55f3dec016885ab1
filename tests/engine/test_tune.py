"""``tune``: one method swept as a tuned grid of one study by the tuned grid's engine:
the same study, trials and tables as ``sweep --grid`` gives the grid file holding the same
table; resumable without repeating a trial or a final run; the flags' refusals."""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path

import optuna
import pytest

from harness.base.errors import HarnessError
from harness.base.metric_keys import metric_key
from harness.cli.main import main
from harness.cli.tune import add_tune_parser
from harness.cli.tune_command import TUNE_ROUND, tune_grid
from harness.config.protocol_files import load_protocol
from harness.engine.tuning.studies import record_storage, record_study, settled, tuned_studies

TESTS = Path(__file__).resolve().parents[1]
METRIC = metric_key("val", "mean_average_precision_at_r")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_tune_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["tune", *argv])


def _tune(*argv: str, train=None) -> int:
    """``tune`` with ``argv`` in this process; ``train``: what trains each run."""
    args = _args(*argv)
    return args.func(args, train=train)


def _fake_training(calls: list):
    """Stands in for ``train_run``: an MLflow run with the tags a table reads and a
    validation history that grows with the head's learning rate, no training."""
    from harness.store.tracking import Tracker

    def run(cfg, splits=None, on_epoch=None):
        calls.append(cfg)
        tracker = Tracker(cfg.experiment, f"{cfg.method}-fake")
        lr = cfg.protocol.optimizer.lr_head
        tracker.log_params(
            {
                "protocol.backbone.name": cfg.protocol.backbone.name,
                "protocol.selection.metric": cfg.protocol.selection.metric,
            }
        )
        tracker.set_tags(
            {
                **cfg.tags,
                "method": cfg.method,
                "dataset": cfg.dataset,
                "loss": cfg.loss,
                "seed": cfg.seed,
                "protocol": cfg.protocol.name,
                "fingerprint": "fake",
                "selection": "validation",
                "deviations": "; ".join(map(str, cfg.deviations)) or "none",
            }
        )
        for epoch, value in ((1, lr * 10), (2, lr * 20)):
            tracker.log_metrics({METRIC: value}, step=epoch)
        test = {} if cfg.search_only else {"mean_average_precision_at_r": lr + 1e-4 * cfg.seed}
        tracker.log_metrics({metric_key("test", k): v for k, v in test.items()}, step=2)
        tracker.finish()
        return {"mlflow_run_id": tracker.run_id, "metrics": test}

    return run


def _common(protocol: Path, storage: str, experiment: str, *extra: str) -> list[str]:
    return [
        "--method",
        "agrouping",
        "--protocol",
        str(protocol),
        "--storage",
        storage,
        "--experiment",
        experiment,
        "--space",
        "optimizer.lr_head",
        *extra,
    ]


def _trials(grid, storage: str) -> dict:
    """Each study's settled trials: ``{label: {number: (params, value, state)}}``."""
    records = record_storage(storage)
    return {
        s.label: {
            n: (t.params, t.value, t.state.name)
            for n, t in settled(record_study(s, records)).items()
        }
        for s in tuned_studies(grid)
    }


def _rows(path: Path) -> list[str]:
    """A Markdown table's rows, without the run counts' and the notes' lines."""
    return [line for line in path.read_text().splitlines() if line.startswith("| ")]


def test_tune_is_the_tuned_grid_of_one_study_that_the_same_grid_file_sweeps(
    workdir, tiny_protocol, capsys
):
    """``tune`` and ``sweep --grid`` over a grid file holding the table ``tune`` builds:
    the same study (trial count, each trial's setting and value) and the same table rows."""
    calls: list = []
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    argv = _common(tiny_protocol, storage, f"tune-{uuid.uuid4().hex[:6]}", "--trials", "3")
    assert _tune(*argv, "--seeds", "0,1", train=_fake_training(calls)) == 0
    tuned = tune_grid(_args(*argv, "--seeds", "0,1"))
    assert len(tuned.cells) == 2 and len(tuned_studies(tuned)) == 1
    assert tuned.tune.trials == 3 and tuned.tune.round == TUNE_ROUND and tuned.tune.method_spaces
    searched = [c for c in calls if c.search_only]
    assert len(searched) == 3 and {c.seed for c in searched} == {2}  # apart from seeds 0, 1
    assert sorted(c.seed for c in calls if not c.search_only) == [0, 1]
    out = capsys.readouterr().out
    assert "best trial " in out and "over seeds [0, 1]" in out

    name = f"same-{uuid.uuid4().hex[:6]}"
    grid_file = workdir / f"{name}.toml"
    grid_file.write_text(
        f'description = "{tuned.description}"\nprotocol = "{tiny_protocol}"\n'
        'methods = ["agrouping"]\nlosses = ["margin"]\nbackbones = ["efficientnet_lite0"]\n'
        'datasets = ["synthetic"]\nseeds = [0, 1]\nbaseline = "agrouping"\n'
        f"[tune]\ntrials = 3\nround = {TUNE_ROUND}\nmethod_spaces = true\n"
        '[tune.space]\n"optimizer.lr_head" = { low = 1e-4, high = 1e-2, log = true }\n'
    )
    again: list = []
    sweep = ["sweep", "--grid", str(grid_file), "--storage", storage]
    assert main(sweep, train=_fake_training(again)) == 0
    from harness.config.grids import load_grid

    grid = load_grid(grid_file)
    assert [c.key for c in grid.cells] == [c.key for c in tuned.cells]
    assert list(_trials(grid, storage).values()) == list(_trials(tuned, storage).values())
    assert len(again) == len(calls)
    tables = workdir / "results" / "tables"
    assert _rows(tables / f"{name}.md") == _rows(tables / f"{tuned.name}.md")
    assert (tables / f"{tuned.name}.settings.md").is_file()


def test_tune_resumes_without_repeating_a_trial_or_a_final_run(workdir, tiny_protocol, capsys):
    calls: list = []
    fake = _fake_training(calls)
    storage = f"sqlite:///{workdir / 'optuna.db'}"
    common = _common(tiny_protocol, storage, f"tune-fake-{uuid.uuid4().hex[:6]}")
    assert _tune(*common, "--trials", "3", "--no-reproduce", train=fake) == 0
    assert len(calls) == 3 and all(c.search_only for c in calls)
    grid = tune_grid(_args(*common, "--trials", "3"))
    (study,) = tuned_studies(grid)
    record = optuna.load_study(study_name=study.name, storage=storage)
    best = max(record.trials, key=lambda t: t.value)
    assert best.value == pytest.approx(best.params["optimizer.lr_head"] * 20)  # its best epoch
    # The method's options, the loss's arguments and the --space field are searched.
    assert {"groups", "diversity_weight", "optimizer.lr_head"} <= set(best.params)
    assert {"loss.args.margin.margin", "loss.args.margin.beta"} <= set(best.params)
    lr = best.distributions["optimizer.lr_head"]
    assert (lr.low, lr.high, lr.log) == pytest.approx((1e-4, 1e-2, True))  # tiny's 1e-3 / 10, * 10
    assert _tune(*common, "--trials", "3", "--no-reproduce", train=fake) == 0
    assert len(calls) == 3  # nothing repeated
    capsys.readouterr()
    assert _tune(*common, "--trials", "3", "--seeds", "0,1", train=fake) == 0
    assert len(calls) == 3 + 2  # the best setting over two seeds
    assert "over seeds [0, 1]" in capsys.readouterr().out
    assert _tune(*common, "--trials", "3", "--seeds", "0,1", train=fake) == 0
    assert len(calls) == 5  # the final runs found in MLflow, not repeated


def test_a_restarted_study_suggests_what_an_uninterrupted_one_does(workdir, tiny_protocol):
    """A trial interrupted (SIGTERM, Ctrl-C) is run again by the next start, and the
    study's trials are those of an uninterrupted one."""

    def study_trials(storage: str, interrupt_at: int | None) -> list:
        calls: list = []
        fake = _fake_training(calls)

        def run(cfg, splits=None, on_epoch=None):
            if len(calls) == interrupt_at:
                calls.append(cfg)
                raise KeyboardInterrupt
            return fake(cfg, splits, on_epoch)

        argv = _common(tiny_protocol, storage, f"tune-restart-{uuid.uuid4().hex[:6]}")
        argv += ["--trials", "3", "--no-reproduce"]
        if interrupt_at is not None:
            with pytest.raises(KeyboardInterrupt):
                _tune(*argv, train=run)
        assert _tune(*argv, train=run) == 0
        (trials,) = _trials(tune_grid(_args(*argv)), storage).values()
        assert len(trials) == 3
        return [trials[n][:2] for n in sorted(trials)]

    uninterrupted = study_trials(f"sqlite:///{workdir / 'a.db'}", None)
    assert study_trials(f"sqlite:///{workdir / 'b.db'}", 1) == uninterrupted


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


def test_seed_is_refused_saying_what_to_use_instead(workdir, tiny_protocol, capsys):
    argv = ["tune", "--method", "plain", "--trials", "1", "--protocol", str(tiny_protocol)]
    assert main([*argv, "--seed", "3"], train=_fake_training([])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --seed: ") and "--seeds" in err[0]


def test_bad_seeds_are_one_line_before_any_trial(workdir, tiny_protocol, capsys):
    calls: list = []
    argv = ["tune", "--method", "plain", "--protocol", str(tiny_protocol), "--trials", "1"]
    argv += ["--storage", f"sqlite:///{workdir / 'optuna.db'}", "--seeds", "0,x"]
    assert main(argv, train=_fake_training(calls)) == 2
    err = capsys.readouterr().err
    assert (
        "error: tune: argument --seeds: expected comma-separated integers >= 0 like 0,1,2, got '0,x'"
        in err
    )
    assert "Traceback" not in err and calls == []


def test_a_quote_in_the_protocol_name_does_not_break_the_final_runs_lookup(workdir, tiny_protocol):
    """The experiment's default name holds the protocol's name; the grid's name is a plain
    file name made of it, and the final runs are found again through the store's filter."""
    quoted = workdir / "o'brien.toml"
    quoted.write_text(tiny_protocol.read_text().replace('name = "tiny"', 'name = "o\'brien"'))
    calls: list = []
    fake = _fake_training(calls)
    argv = ["--method", "plain", "--protocol", str(quoted), "--space", "optimizer.lr_head"]
    argv += ["--storage", f"sqlite:///{workdir / 'optuna.db'}", "--trials", "1", "--seeds", "0"]
    assert _tune(*argv, train=fake) == 0
    assert len(calls) == 2
    grid = tune_grid(_args(*argv))
    assert grid.experiment == f"tune-plain-synthetic-{load_protocol(quoted).name}"
    assert "'" not in grid.name
    assert _tune(*argv, train=fake) == 0
    assert len(calls) == 2  # the final run was found again, not run again


@pytest.mark.slow
def test_tune_with_folds_scores_the_mean_over_class_disjoint_folds_without_the_test_split(
    workdir, tiny_protocol
):
    import mlflow

    storage = f"sqlite:///{workdir / 'optuna.db'}"
    experiment = f"tune-folds-{uuid.uuid4().hex[:6]}"
    argv = ["--method", "plain", "--protocol", str(tiny_protocol), "--storage", storage]
    argv += ["--experiment", experiment, "--folds", "2", "--trials", "1", "--no-reproduce"]
    assert _tune(*argv) == 0
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(f"{experiment}-search")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.tags["tune_fold"] for r in runs) == ["0", "1"]
    assert not any(k.startswith("test/") for r in runs for k in r.data.metrics)
    best = [max(v.value for v in client.get_metric_history(r.info.run_id, METRIC)) for r in runs]
    (trials,) = _trials(tune_grid(_args(*argv)), storage).values()
    params, value, _ = trials[0]
    assert value == pytest.approx(sum(best) / 2)
    assert {"loss.args.margin.margin", "loss.args.margin.beta"} <= set(params)


def test_tune_refuses_more_folds_than_the_training_classes_allow(workdir, tiny_protocol):
    with pytest.raises(HarnessError, match="--folds = 500 needs at least 1000 training classes"):
        _tune(
            "--method", "plain", "--protocol", str(tiny_protocol), "--folds", "500", "--trials", "1"
        )


def test_a_failed_trial_is_exit_1_naming_it_and_the_next_start_runs_it_again(
    workdir, tiny_protocol, capsys
):
    """A trial whose run fails (not a diverging loss: that trial is pruned) leaves the
    study short: its best trial so far is printed, then one line on stderr naming the
    failed task, exit status 1; the next start runs it again and finishes the study."""
    calls: list = []
    fake = _fake_training(calls)

    def failing_once(cfg, splits=None, on_epoch=None):
        if len(calls) == 1:
            calls.append(cfg)
            raise HarnessError("a run that fails")
        return fake(cfg, splits, on_epoch)

    argv = _common(tiny_protocol, f"sqlite:///{workdir / 'optuna.db'}", "tune-failed")
    argv += ["--trials", "2", "--no-reproduce"]
    assert _tune(*argv, train=failing_once) == 1
    captured = capsys.readouterr()
    assert "best trial 0: " in captured.out
    line = captured.err.strip().splitlines()[-1]
    assert line.startswith("1 task(s) failed (tune:") and "trial 1)" in line
    assert _tune(*argv, train=failing_once) == 0
    (trials,) = _trials(tune_grid(_args(*argv)), f"sqlite:///{workdir / 'optuna.db'}").values()
    assert sorted(trials) == [0, 1]
