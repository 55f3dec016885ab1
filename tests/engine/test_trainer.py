"""The trainer through its public API, recording into an InMemoryRecorder and
checkpointing into an InMemoryCheckpointer: the epochs' metrics and checkpoints, the
selected epoch, the test, and a resume from a checkpoint that ends where an uninterrupted
run does; and every recorder and checkpointer satisfying its protocol."""

from __future__ import annotations

import pytest

from harness.base.metric_keys import metric_key
from harness.config.protocol_files import load_protocol
from harness.engine import (
    Checkpointer,
    FolderCheckpointer,
    InMemoryCheckpointer,
    InMemoryRecorder,
    MlflowRecorder,
    NullRecorder,
    Recorder,
    RunConfig,
    RunFolder,
    Trainer,
    prepare_splits,
)
from tests.conftest import TINY_PROTOCOL


@pytest.fixture(scope="module")
def cfg() -> RunConfig:
    protocol = load_protocol(TINY_PROTOCOL).for_dataset("synthetic")  # 2 epochs of 3 batches
    return RunConfig.build(
        protocol, method="plain", dataset="synthetic", loss=protocol.loss.name, seed=0
    )


@pytest.fixture(scope="module")
def splits(cfg, data_root):
    return prepare_splits(cfg.protocol, "synthetic", data_root, seed=0)


@pytest.fixture(scope="module")
def trained(cfg, splits) -> tuple[Trainer, InMemoryRecorder, InMemoryCheckpointer, int]:
    """A whole run: both epochs, the selected weights loaded and tested."""
    recorder, checkpointer = InMemoryRecorder(), InMemoryCheckpointer()
    trainer = Trainer.from_config(cfg, splits, recorder=recorder, checkpointer=checkpointer)
    trainer.fit()
    selected = trainer.load_selected_weights()
    trainer.test(selected)
    return trainer, recorder, checkpointer, selected


def test_the_trainer_records_every_epoch_the_selected_epoch_and_the_test(cfg, trained):
    trainer, recorder, checkpointer, selected = trained
    metric = metric_key("val", cfg.protocol.selection.metric)
    assert [r["epoch"] for r in recorder.epochs] == [1, 2]
    assert all(metric in r and metric_key("train", "epoch_loss") in r for r in recorder.epochs)
    best = max(recorder.epochs, key=lambda r: r[metric])  # the first of equal scores wins
    assert selected == best["epoch"] == trainer.progress.best["epoch"]
    assert [f.global_step for f in recorder.flushes] == [
        3,
        6,
    ]  # sync_every exceeds an epoch's 3 steps
    assert [c["epoch"] for c in checkpointer.saved] == [1, 2]
    assert checkpointer.saved[-1]["history"] == recorder.epochs
    assert recorder.selected_epoch == selected
    assert 0 <= recorder.test["mean_average_precision_at_r"] <= 1


def test_finishing_saves_the_selected_weights_then_runs_the_end_of_run_steps(trained):
    trainer, recorder, checkpointer, selected = trained
    seen: list[tuple[str, int]] = []
    trainer.end_of_run = [
        lambda run: seen.append(("first", run.selected_epoch)),
        lambda run: seen.append(("second", run.selected_epoch)),
    ]
    finished = trainer.finish(selected, recorder.test)
    assert seen == [("first", selected), ("second", selected)]
    assert finished.weights is None and finished.test == recorder.test
    assert checkpointer.selected is not None
    assert checkpointer.selected["selected_epoch"] == selected
    assert checkpointer.selected["method"] == "plain"
    assert set(checkpointer.selected["model"]) == set(trainer.model.state_dict())


def test_a_folder_checkpointer_saves_the_selected_weights_as_model_pt(tmp_path):
    checkpointer = FolderCheckpointer(RunFolder(tmp_path / "run"), {"fingerprint": "f"})
    saved = checkpointer.save_selected({"model": {}, "method": "plain", "selected_epoch": 1})
    assert saved is not None and saved.path == tmp_path / "run" / "model.pt"
    assert saved.relpath == "run/model.pt" and len(saved.sha256) == 64


def test_a_trainer_resumed_after_an_epoch_ends_as_an_uninterrupted_one(cfg, splits, trained):
    _, whole, checkpoints, _ = trained
    resumed = InMemoryRecorder()
    trainer = Trainer.from_config(cfg, splits, recorder=resumed)
    trainer.resume(checkpoints.saved[0])
    trainer.fit()

    def without_system(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith("system/")}

    assert [r["epoch"] for r in resumed.epochs] == [2]
    assert without_system(resumed.epochs[0]) == without_system(whole.epochs[1])


def test_fit_stops_at_the_epoch_asked_and_a_resume_continues_from_the_checkpointer(cfg, splits):
    """One epoch, then a new trainer resumed from the checkpointer's last checkpoint trains
    the second: the two records are those of an uninterrupted run's epochs."""
    first, checkpointer = InMemoryRecorder(), InMemoryCheckpointer()
    Trainer.from_config(cfg, splits, recorder=first, checkpointer=checkpointer).fit(until=1)
    assert [r["epoch"] for r in first.epochs] == [1]
    second = InMemoryRecorder()
    trainer = Trainer.from_config(cfg, splits, recorder=second, checkpointer=checkpointer)
    trainer.resume(checkpointer.load())
    trainer.fit()
    assert [r["epoch"] for r in second.epochs] == [2]
    assert [c["epoch"] for c in checkpointer.saved] == [1, 2]


def test_every_recorder_and_checkpointer_satisfies_its_protocol(cfg, splits, tmp_path):
    folder = RunFolder(tmp_path / "run")
    mlflow = MlflowRecorder(cfg, folder, experiment="e", fingerprint="f", splits=splits)
    for recorder in (InMemoryRecorder(), NullRecorder(), mlflow):
        assert isinstance(recorder, Recorder), type(recorder).__name__
    for checkpointer in (InMemoryCheckpointer(), FolderCheckpointer(folder)):
        assert isinstance(checkpointer, Checkpointer), type(checkpointer).__name__


def test_a_folder_checkpointer_saves_what_a_resume_loads(cfg, splits, tmp_path):
    """Each epoch's checkpoint, whatever the recorder, in the run's folder (``last.pt``
    with its checksum file), with the checkpointer's stamp."""
    checkpointer = FolderCheckpointer(RunFolder(tmp_path / "run"), {"fingerprint": "f"})
    recorder = InMemoryRecorder()
    Trainer.from_config(cfg, splits, recorder=recorder, checkpointer=checkpointer).fit(until=1)
    loaded = checkpointer.load()
    assert loaded["epoch"] == 1 and loaded["fingerprint"] == "f"
    assert loaded["history"] == recorder.epochs


def test_the_engine_package_exports_each_public_name_from_its_module():
    import harness.engine as engine

    missing = [name for name in engine.__all__ if getattr(engine, name, None) is None]
    assert missing == []
    assert {"Trainer", "Recorder", "Checkpointer", "RunConfig", "train_run"} <= set(dir(engine))
