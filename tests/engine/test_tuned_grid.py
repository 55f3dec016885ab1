"""A tuned grid (``[tune]``): its class-disjoint folds, its refusals, the determinism of
its trials' settings, the sealed test split, and (slow) a whole sweep across two workers
whose studies, runs and tables are what MLRC's protocol asks for."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import optuna
import pytest

from harness.base.errors import HarnessError
from harness.base.metric_keys import metric_key
from harness.components.data import (
    ArrayImageSet,
    DatasetSplits,
    SealedSplitRead,
    class_folds,
    fold_splits,
    seal_test,
)
from harness.config.grids import load_grid
from harness.engine.run.data import prepare_splits
from harness.engine.run.run_config import RunConfig
from harness.engine.run.training import train_run
from harness.engine.tuning.studies import settled, trial_setting, tuned_studies

REPO = Path(__file__).resolve().parents[2]
GRIDS = Path(__file__).resolve().parents[1] / "grids"
TUNED = GRIDS / "tiny-tuned.toml"


def _splits(train_classes: int = 12, test_classes: int = 6, per_class: int = 3) -> DatasetSplits:
    def images(first: int, count: int) -> ArrayImageSet:
        labels = np.repeat(np.arange(first, first + count), per_class)
        return ArrayImageSet(np.zeros((labels.size, 8, 8, 3), np.uint8), labels)

    return DatasetSplits("toy", images(0, train_classes), images(100, test_classes))


@pytest.mark.parametrize("folds", [2, 3, 4])
def test_folds_are_class_disjoint_cover_the_training_classes_and_are_drawn_from_the_seed(folds):
    splits = _splits()
    parts = class_folds(splits.train.labels, folds, seed=0)
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(12))  # every training class, once
    assert len(set(joined.tolist())) == joined.size
    assert not set(joined.tolist()) & set(splits.test.labels.tolist())  # no test class
    # The same on every worker and after a restart: a function of the seed alone.
    again = class_folds(splits.train.labels[::-1].copy(), folds, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(parts, class_folds(splits.train.labels, folds, seed=1), strict=True)
    )
    for fold in range(folds):
        split = fold_splits(_splits(), folds, fold, seed=0)
        assert set(split.val.labels.tolist()) == set(parts[fold].tolist())
        assert not set(split.val.labels.tolist()) & set(split.train.labels.tolist())
        assert len(split.train) + len(split.val) == len(splits.train)
        assert np.array_equal(split.test.labels, splits.test.labels)


def test_more_folds_than_the_classes_allow_is_refused():
    with pytest.raises(HarnessError, match="folds = 7 needs at least 14 training classes"):
        class_folds(_splits().train.labels, 7, seed=0)


def test_a_sealed_test_split_refuses_every_read_but_keeps_its_size_and_digest():
    splits = _splits()
    sealed = seal_test(splits, "the search")
    assert len(sealed.test) == len(splits.test)
    for read in (
        lambda: sealed.test.labels,
        lambda: sealed.test.keys(),
        lambda: sealed.test.read(0),
        lambda: sealed.test.subset(np.arange(2)),
    ):
        with pytest.raises(SealedSplitRead, match="sealed during the search"):
            read()
    assert sealed.digest() == seal_test(_splits(), "the search").digest()
    assert sealed.digest() != seal_test(_splits(test_classes=5), "the search").digest()


def _grid_file(tmp_path: Path, tune: str, extra: str = "") -> Path:
    text = TUNED.read_text().split("[tune]")[0]
    text = text.replace(
        'protocol = "../protocols/tiny.toml"', f'protocol = "{GRIDS.parent}/protocols/tiny.toml"'
    )
    path = tmp_path / "g.toml"
    path.write_text(text + extra + "[tune]\n" + tune)
    return path


@pytest.mark.parametrize(
    "tune, message",
    [
        ("trials = 0\n", "tune.trials"),
        ("trials_per_dimension = 0\n", "tune.trials_per_dimension"),
        ("trials = 2\nfolds = 0\n", "tune.folds"),
        ('trials = 2\n[tune.space]\n"optimizer.nope" = [0.1, 1.0]\n', "not a protocol field"),
        ('trials = 2\n[tune.space]\n"optimizer.lr_head" = [1e-3, 1e-4]\n', "inverted range"),
        ('trials = 2\n[tune.space]\n"optimizer.lr_head" = [1e-3, 1e-3]\n', "empty or inverted"),
        ('trials = 2\n[tune.space]\n"loss.margin.nope" = [0.0, 1.0]\n', "no argument 'nope'"),
        ('trials = 2\n[tune.space]\n"method.plain.nope" = {choices = [1]}\n', "no option 'nope'"),
        (
            'trials = 2\n[tune.space]\n"loss.triplet.margin" = [0.0, 1.0]\n',
            "not a loss of the grid",
        ),
    ],
)
def test_a_bad_tune_table_is_one_line_naming_the_key(tmp_path, tune, message):
    with pytest.raises(HarnessError, match=message) as err:
        load_grid(_grid_file(tmp_path, tune))
    assert "\n" not in str(err.value)


def test_an_integer_target_is_searched_in_integers():
    from harness.config.protocol_files import load_protocol
    from harness.config.tuning import parse_tune, study_space

    protocol = load_protocol(GRIDS.parent / "protocols" / "tiny.toml")
    table = {"trials": 2, "space": {"sampling.samples_per_class": [2, 4]}}
    spec = parse_tune(table, protocol, ["plain"], ["margin"])
    entry = study_space(spec, "plain", "margin", protocol)["sampling.samples_per_class"]
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    assert isinstance(entry.suggest(trial, "sampling.samples_per_class"), int)


def test_a_tuned_grid_needs_selection_on_validation(tmp_path):
    path = _grid_file(tmp_path, "trials = 2\n", extra='set = {"selection.mode" = "test-paper"}\n')
    with pytest.raises(HarnessError, match="never chosen on the test set"):
        load_grid(path)


def test_the_tune_table_enters_the_cells_keys_and_the_smoke_version_replaces_its_keys():
    grid, smoke = load_grid(TUNED), load_grid(TUNED, smoke=True)
    assert grid.tune.trials == 3 and grid.tune.folds == 2
    assert smoke.tune.trials == 2 and smoke.tune.folds == 1 and smoke.tune.round == 2
    untuned = load_grid(GRIDS / "tiny.toml")
    assert {c.key for c in grid.cells}.isdisjoint({c.key for c in untuned.cells})
    studies = tuned_studies(grid)
    assert [s.first.method for s in studies] == ["plain", "ngrouping"]
    assert all(len(s.cells) == 2 and len({c.study_key for c in s.cells}) == 1 for s in studies)


class _Settled:
    """A settled trial as :func:`trial_setting` reads it from a study's record."""

    def __init__(self, params, distributions, value):
        self.params, self.distributions, self.value = params, distributions, value
        self.state = optuna.trial.TrialState.COMPLETE
        self.intermediate_values = {0: value}


def test_a_trials_setting_depends_only_on_the_earlier_rounds_in_trial_order():
    study = tuned_studies(load_grid(TUNED))[0]  # round = 2
    first = trial_setting(study, 0, {})
    assert first == trial_setting(study, 0, {}) and first[0] != trial_setting(study, 1, {})[0]
    history = {n: _Settled(*trial_setting(study, n, {})[:2], value=0.1 * (n + 1)) for n in range(2)}
    third = trial_setting(study, 2, history)
    # A later trial's result (same round or after) changes nothing; the history's dict
    # order (the order results arrived in) changes nothing either.
    later = {**history, 3: _Settled(*trial_setting(study, 3, history)[:2], value=0.9)}
    assert trial_setting(study, 2, later) == third
    assert trial_setting(study, 2, dict(reversed(list(history.items())))) == third
    with pytest.raises(HarnessError, match=r"needs trials \[1\] settled first"):
        trial_setting(study, 2, {0: history[0]})


def test_a_search_run_never_reads_the_test_split_and_a_full_run_on_sealed_splits_fails(
    workdir, tiny_protocol
):
    from harness.config.protocol_files import load_protocol

    protocol = load_protocol(tiny_protocol)
    splits = seal_test(prepare_splits(protocol, "synthetic", None, seed=0), "the search")
    common = dict(method="plain", dataset="synthetic", loss="margin", seed=0)
    record = train_run(
        RunConfig.build(protocol, search_only=True, experiment="sealed", **common), splits
    )
    run = mlflow.MlflowClient().get_run(record["mlflow_run_id"])
    assert run.info.status == "FINISHED" and record["metrics"] == {}
    assert any(k.startswith("val/") for k in run.data.metrics)
    assert not any(k.startswith("test/") for k in run.data.metrics)
    with pytest.raises(SealedSplitRead):
        train_run(RunConfig.build(protocol, experiment="sealed", **common), splits)


def _sweep(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", "sweep", "--grid", str(TUNED), *extra],
        cwd=workdir,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "DML_HARNESS_LOG_MODEL": "0"},
        timeout=1500,
    )


@pytest.mark.slow
def test_a_tuned_sweep_on_two_workers_gives_every_study_its_budget_and_mlrc_reports(workdir):
    storage = f"sqlite:///{workdir}/optuna.db"
    done = _sweep(workdir, "--workers", "2", "--storage", storage)
    assert done.returncode == 0, done.stderr[-3000:]
    grid = load_grid(TUNED)
    rdb = optuna.storages.RDBStorage(storage)
    counts = {
        len(settled(optuna.load_study(study_name=s.name, storage=rdb))) for s in tuned_studies(grid)
    }
    assert counts == {3}  # the same budget for every study
    client = mlflow.MlflowClient()

    def runs(experiment: str) -> list:
        exp = client.get_experiment_by_name(experiment)
        return client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")

    search = runs("grid-tiny-tuned-search")
    assert len(search) == 2 * 3 * 2  # studies x trials x folds
    assert all(not any(k.startswith("test/") for k in r.data.metrics) for r in search)
    assert all(r.data.tags["tune_role"] == "trial" for r in search)
    # Every trial of both studies, on either worker, trained on the same two folds.
    assert len({r.data.tags["tune_fold_classes"] for r in search}) == 2
    reports, table_sets = [], []
    for run in runs("grid-tiny-tuned"):  # the reports, and the run that holds the table set
        (table_sets if "table_set" in run.data.tags else reports).append(run)
    assert [run.info.run_name for run in table_sets] == ["tiny-tuned"]
    finals = reports
    assert (
        sorted(r.data.tags["tune_report"] for r in finals)
        == ["concatenated"] * 4 + ["separated"] * 4
    )
    assert all(metric_key("test", "mean_average_precision_at_r") in r.data.metrics for r in finals)
    assert len(runs("grid-tiny-tuned-folds")) == 4 * 2
    tables = workdir / "results" / "tables"
    markdown = (tables / "tiny-tuned.md").read_text()
    assert (
        "Tuned: every row's hyperparameters chosen by the same budget, 3 trials (Optuna's TPE"
        in markdown
    )
    assert "[tuned]" in markdown
    appendix = (tables / "tiny-tuned.settings.md").read_text()
    assert appendix.count("| efficientnet_lite0 | margin | synthetic |") == 2
    assert "\\begin{tabular}" in (tables / "tiny-tuned.settings.tex").read_text()
    assert (tables / "tiny-tuned.search.png").stat().st_size > 1000
    assert "MAP@R" in (tables / "tiny-tuned-concatenated.md").read_text()
    for run in finals:
        history = json.loads(run.data.tags["tune_history"])
        assert len(history) == 3
    _check_the_notes_and_the_search_apart(markdown, search, runs("grid-tiny-tuned-folds"), client)


def _check_the_notes_and_the_search_apart(markdown: str, search: list, folds: list, client) -> None:
    """The tuned table states each row's search and describes the fold selection as it
    ran; the final fold runs trained with seeds apart from the search's, so none repeats
    a trial (no final validation history equals a trial's)."""
    assert "Search per row (Optuna, all 3 trials random (TPE never fitted))" in markdown
    for study in tuned_studies(load_grid(TUNED)):
        dims = len(trial_setting(study, 0, {})[1])  # the distributions the search drew from
        assert f"{study.first.method} (margin, synthetic): {dims} dimensions, " in markdown
    assert re.search(r"\d+ / \d+ / 3, (late gain|budget check)", markdown)
    assert (
        "each of the 2 fold models trained on 1/2 of the training classes and its epoch chosen by "
        "the best validation MAP@R on the held-out fold (2 class-disjoint folds" in markdown
    )
    assert "The search trained with seed 2, the reported runs with seeds 0, 1" in markdown
    key = metric_key("val", "mean_average_precision_at_r")

    def history(run) -> tuple:
        return tuple(m.value for m in client.get_metric_history(run.info.run_id, key))

    trials = {history(r) for r in search}
    assert all(history(r) and history(r) not in trials for r in folds)


def _state(workdir: Path, storage: str) -> dict:
    """Every study's settled trials (number: params, value) and the tables' text."""
    grid = load_grid(TUNED)
    rdb = optuna.storages.RDBStorage(storage)
    trials = {
        s.label: {
            n: (t.params, t.value, t.state.name)
            for n, t in settled(optuna.load_study(study_name=s.name, storage=rdb)).items()
        }
        for s in tuned_studies(grid)
    }
    tables = workdir / "results" / "tables"
    texts = {p.name: p.read_bytes() for p in sorted(tables.glob("tiny-tuned*"))}
    return {"trials": trials, "tables": texts}


def _sweep_in(folder: Path, fault: str = "") -> subprocess.CompletedProcess:
    """The tuned grid swept on 2 workers in ``folder`` (its own stores and checkpoints),
    ``fault``: the test-only ``PART:N:ACTION`` of :mod:`harness.cli.faults`. The
    grace period (an hour) never passes: only a worker's death can retry its task."""
    folder.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db",
        "DML_HARNESS_CHECKPOINTS": str(folder / "checkpoints"),
        "DML_HARNESS_LOG_MODEL": "0",
    }
    if fault:
        env["DML_HARNESS_FAULT"] = fault
    else:
        env.pop("DML_HARNESS_FAULT", None)
    argv = [sys.executable, "-m", "harness", "sweep", "--grid", str(TUNED), "--workers", "2"]
    argv += ["--storage", f"sqlite:///{folder}/optuna.db", "--grace", "3600"]
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_root) -> dict:
    """The studies and tables of the tuned grid swept without a fault."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    done = _sweep_in(folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return _state(folder, f"sqlite:///{folder}/optuna.db")


TABLES = {
    "tiny-tuned.md",
    "tiny-tuned.tex",
    "tiny-tuned-concatenated.md",
    "tiny-tuned-concatenated.tex",
    "tiny-tuned.settings.md",
    "tiny-tuned.settings.tex",
    "tiny-tuned.search.png",
    "tiny-tuned.forest.png",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase, fault",
    [("search", "train_batch:5:kill"), ("final", "selected:2:kill")],
    ids=["search", "final"],
)
def test_a_tuned_sweep_killed_ends_in_one_start_as_an_uninterrupted_one(
    tmp_path, uninterrupted, phase, fault
):
    """Both workers killed (SIGKILL) in the search (at their 5th training batch: inside
    their first search runs, of 3 batches an epoch) or in the final phase (at the selected weights of their
    2nd final run, the search over), then one start at once: the dead workers' trials or final
    cells are queued again without waiting for their heartbeats, and the sweep ends with
    the studies (each trial's setting and value) and the tables of an uninterrupted one."""
    storage = f"sqlite:///{tmp_path}/optuna.db"
    killed = _sweep_in(tmp_path, fault)
    assert killed.returncode != 0
    budgets = [len(t) for t in _state(tmp_path, storage)["trials"].values()]
    if phase == "search":
        assert all(n < 3 for n in budgets)  # the search unfinished
    else:
        assert budgets == [3, 3]  # the search over, the final phase unfinished
    assert not (tmp_path / "results" / "tables").exists()
    again = _sweep_in(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "ended without finishing it; queued again" in again.stderr
    got = _state(tmp_path, storage)
    assert got["trials"] == uninterrupted["trials"]
    assert TABLES <= set(got["tables"])
    assert got["tables"] == uninterrupted["tables"]


def test_trial_n_of_every_method_draws_the_same_shared_dimensions_while_random():
    """Common random numbers: the studies of one block (same loss, seeded alike) draw trial
    n's shared dimensions (learning rates, the loss's arguments) first, so their random
    start-up trials try the same values whatever each method searches of its own."""
    grid = load_grid(
        Path(__file__).resolve().parents[2] / "protocols" / "grids" / "fair-tuned-roth2020.toml"
    )
    assert grid.tune is not None
    # the methods' own spaces searched too, so that their sizes differ
    grid = dataclasses.replace(grid, tune=dataclasses.replace(grid.tune, method_spaces=True))
    studies = tuned_studies(grid)
    first = studies[0].first
    block = [s for s in studies if (s.first.loss, s.first.dataset) == (first.loss, first.dataset)]
    own_sizes = set()
    for number in (0, 1, 3):  # the first round: no settled trial needed
        shared = []
        for study in block:
            params = trial_setting(study, number, {})[0]
            common = {k: v for k, v in params.items() if "." in k}
            own_sizes.add(len(params) - len(common))
            shared.append(common)
        assert len(block) > 3 and all(s == shared[0] for s in shared), number
        assert shared[0]  # the learning rates and the loss's arguments are searched
    assert len(own_sizes) > 1  # the methods' own spaces differ in size


def test_trials_per_dimension_scales_each_studys_budget_with_its_space(tmp_path):
    """With method spaces searched the studies' spaces differ; ``trials_per_dimension``
    gives each study that many trials per dimension, and the budget note says the rule."""
    grid = load_grid(
        _grid_file(tmp_path, "trials_per_dimension = 2\nmethod_spaces = true\nfolds = 1\n")
    )
    studies = tuned_studies(grid)
    sizes = {s.first.method: (s.dimensions, s.trials) for s in studies}
    assert all(trials == 2 * dims for dims, trials in sizes.values())
    assert len({dims for dims, _ in sizes.values()}) > 1  # the spaces differ
    assert grid.tune.budget.startswith("2 trials per searched dimension")
    flat = load_grid(_grid_file(tmp_path, "trials = 3\n"))
    assert {s.trials for s in tuned_studies(flat)} == {3}
