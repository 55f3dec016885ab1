"""Where a trainer's results go: the :class:`Recorder` interface, an in-memory recorder
(tests, notebooks) and one that records nothing (the processes other than 0 of a
distributed run). The tracking store and checkpoint files are
:class:`~harness.engine.mlflow_recorder.MlflowRecorder`'s."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["StepFlush", "Recorder", "InMemoryRecorder", "NullRecorder"]


@dataclass(frozen=True)
class StepFlush:
    """What the training loop reads from the device at one flush: every
    ``[training] sync_every`` steps (:class:`~harness.config.sections.TrainingSpec`) and at
    the end of an epoch, in one transfer. Between two flushes the loop only queues work.

    ``global_step``: steps trained by the run so far (the last step read, counted from 1);
    ``step_losses``: the loss of each step since the previous flush, the last one at
    ``global_step``; ``lr``: the learning rate of the first parameter group (the backbone's;
    the schedules scale every group alike); ``loss_sums``: the epoch's running sums of each
    loss term times its batch size (``""``: the total); ``images``: the epoch's images so far."""

    epoch: int
    global_step: int
    step_losses: tuple[float, ...]
    lr: float
    loss_sums: dict[str, float]
    images: int


class Recorder(Protocol):
    """What a :class:`~harness.engine.trainer.Trainer` reports as it trains and tests."""

    def record_flush(self, flush: StepFlush) -> None:
        """The step losses read at one flush of the training loop."""

    def record_epoch(self, record: dict[str, Any], checkpoint: dict[str, Any]) -> None:
        """An epoch's ``record`` (``epoch`` and the metrics under their logged keys) and the
        ``checkpoint`` a resume would continue from after it."""

    def record_test(self, scores: dict[str, float], selected_epoch: int) -> None:
        """The test scores of the weights of ``selected_epoch`` (for an evaluate-only run,
        the epoch its base run selected)."""


@dataclass
class InMemoryRecorder:
    """A :class:`Recorder` that keeps everything: the flushes, the epoch records, a copy of
    each epoch's checkpoint, the test scores and the selected epoch."""

    flushes: list[StepFlush] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    test: dict[str, float] | None = None
    selected_epoch: int | None = None

    def record_flush(self, flush: StepFlush) -> None:
        self.flushes.append(flush)

    def record_epoch(self, record: dict[str, Any], checkpoint: dict[str, Any]) -> None:
        self.epochs.append(dict(record))
        # A copy: the checkpoint holds the live tensors of the model and optimizer.
        self.checkpoints.append(copy.deepcopy(checkpoint))

    def record_test(self, scores: dict[str, float], selected_epoch: int) -> None:
        self.test, self.selected_epoch = dict(scores), selected_epoch


class NullRecorder:
    """A :class:`Recorder` that records nothing: a distributed run's processes other than
    0 train their share, and process 0 records the run."""

    def record_flush(self, flush: StepFlush) -> None:
        pass

    def record_epoch(self, record: dict[str, Any], checkpoint: dict[str, Any]) -> None:
        pass

    def record_test(self, scores: dict[str, float], selected_epoch: int) -> None:
        pass
