"""The trainer through its public API, recording into an InMemoryRecorder: the epochs'
metrics and checkpoints, the selected epoch, the test, and a resume from a checkpoint
that ends where an uninterrupted run does."""

from __future__ import annotations

import pytest

from harness.base.metric_keys import metric_key
from harness.config.protocol_files import load_protocol
from harness.engine.data import prepare_splits
from harness.engine.recorder import InMemoryRecorder
from harness.engine.run_config import RunConfig
from harness.engine.trainer import Trainer
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
def trained(cfg, splits) -> tuple[Trainer, InMemoryRecorder, int]:
    """A whole run: both epochs, the selected weights loaded and tested."""
    recorder = InMemoryRecorder()
    trainer = Trainer.build(cfg, splits, recorder=recorder)
    trainer.fit()
    selected = trainer.load_selected_weights()
    trainer.test(selected)
    return trainer, recorder, selected


def test_the_trainer_records_every_epoch_the_selected_epoch_and_the_test(cfg, trained):
    trainer, recorder, selected = trained
    metric = metric_key("val", cfg.protocol.selection.metric)
    assert [r["epoch"] for r in recorder.epochs] == [1, 2]
    assert all(metric in r and metric_key("train", "epoch_loss") in r for r in recorder.epochs)
    best = max(recorder.epochs, key=lambda r: r[metric])  # the first of equal scores wins
    assert selected == best["epoch"] == trainer.progress.best["epoch"]
    assert [f.global_step for f in recorder.flushes] == [
        3,
        6,
    ]  # sync_every exceeds an epoch's 3 steps
    assert [c["epoch"] for c in recorder.checkpoints] == [1, 2]
    assert recorder.checkpoints[-1]["history"] == recorder.epochs
    assert recorder.selected_epoch == selected
    assert 0 <= recorder.test["mean_average_precision_at_r"] <= 1


def test_a_trainer_resumed_after_an_epoch_ends_as_an_uninterrupted_one(cfg, splits, trained):
    _, whole, _ = trained
    resumed = InMemoryRecorder()
    trainer = Trainer.build(cfg, splits, recorder=resumed)
    trainer.resume(whole.checkpoints[0])
    trainer.fit()

    def without_system(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith("system/")}

    assert [r["epoch"] for r in resumed.epochs] == [2]
    assert without_system(resumed.epochs[0]) == without_system(whole.epochs[1])
