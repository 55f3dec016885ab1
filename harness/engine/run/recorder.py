"""Where a run's results go: the :class:`Recorder` interface for the whole life of a run
(open, start, every flush, epoch and test, finish or fail), an in-memory recorder (tests,
notebooks) and one that records nothing (the processes other than 0 of a distributed
run). The tracking store is :class:`~harness.engine.run.mlflow_recorder.MlflowRecorder`'s;
the resumable checkpoints are a :class:`~harness.engine.run.checkpoints.Checkpointer`'s."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import nn

from harness.engine.run.checkpoints import SavedWeights

__all__ = ["StepFlush", "FinishedRun", "Recorder", "InMemoryRecorder", "NullRecorder"]


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


@dataclass(frozen=True)
class FinishedRun:
    """A run whose training and test are done: the ``model`` with the weights of
    ``selected_epoch`` loaded (for an evaluate-only run, the epoch its base run selected)
    and their ``test`` scores; ``weights``: where the checkpointer saved those weights (None:
    nowhere a file names)."""

    model: nn.Module
    selected_epoch: int
    test: dict[str, float]
    weights: SavedWeights | None = None


@runtime_checkable
class Recorder(Protocol):
    """Where :func:`~harness.engine.run.training.train_run` and its
    :class:`~harness.engine.run.trainer.Trainer` report one run, from its start to its end:
    :meth:`open` and :meth:`start`, then :meth:`record_flush` at every flush of the step
    loop, :meth:`record_epoch` after each epoch, :meth:`record_test` once, and
    :meth:`finish` (or :meth:`fail`) last."""

    @property
    def run_id(self) -> str:
        """The run's id in the recorder's store ("" where it has none)."""
        ...

    def open(self, run_id: str | None = None) -> None:
        """Begin the run: continue ``run_id`` (the run a checkpoint or an evaluate-only
        run's earlier attempt belongs to) where the store has it, else a new run."""

    def start(self, checkpoint: dict[str, Any] | None) -> None:
        """Describe the run before its first epoch: what it is (a new run) or that it
        continues after ``checkpoint``'s epoch (a resumed one)."""

    def record_flush(self, flush: StepFlush) -> None:
        """The step losses read at one flush of the training loop."""

    def record_epoch(self, record: dict[str, Any]) -> None:
        """An epoch's ``record``: ``epoch`` and the metrics under their logged keys."""

    def record_test(self, scores: dict[str, float], selected_epoch: int) -> None:
        """The test scores of the weights of ``selected_epoch`` (for an evaluate-only run,
        the epoch its base run selected)."""

    def finish(self, result: FinishedRun | None) -> None:
        """The run ended well: ``result`` holds its selected weights and their test scores
        (None: a search trial, scored on validation, whose test split stays unread)."""

    def fail(self, err: BaseException) -> None:
        """The run stopped on ``err`` (a ``KeyboardInterrupt``: interrupted)."""


@dataclass
class InMemoryRecorder:
    """A :class:`Recorder` that keeps everything: the run it continued, the checkpoint it
    started from, the flushes, the epoch records, the test scores with the selected
    epoch, and how the run ended (``status``: ``RUNNING``, ``FINISHED``, ``FAILED`` or
    ``KILLED``)."""

    flushes: list[StepFlush] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    test: dict[str, float] | None = None
    selected_epoch: int | None = None
    continued: str | None = None
    started_from: dict[str, Any] | None = None
    status: str = ""
    error: BaseException | None = None
    result: FinishedRun | None = None

    @property
    def run_id(self) -> str:
        return ""

    def open(self, run_id: str | None = None) -> None:
        self.continued, self.status = run_id, "RUNNING"

    def start(self, checkpoint: dict[str, Any] | None) -> None:
        self.started_from = None if checkpoint is None else copy.deepcopy(checkpoint)

    def record_flush(self, flush: StepFlush) -> None:
        self.flushes.append(flush)

    def record_epoch(self, record: dict[str, Any]) -> None:
        self.epochs.append(dict(record))

    def record_test(self, scores: dict[str, float], selected_epoch: int) -> None:
        self.test, self.selected_epoch = dict(scores), selected_epoch

    def finish(self, result: FinishedRun | None) -> None:
        self.status, self.result = "FINISHED", result

    def fail(self, err: BaseException) -> None:
        self.status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        self.error = err


class NullRecorder:
    """A :class:`Recorder` that records nothing: a distributed run's processes other than
    0 train their share, and process 0 records the run."""

    @property
    def run_id(self) -> str:
        return ""

    def open(self, run_id: str | None = None) -> None:
        pass

    def start(self, checkpoint: dict[str, Any] | None) -> None:
        pass

    def record_flush(self, flush: StepFlush) -> None:
        pass

    def record_epoch(self, record: dict[str, Any]) -> None:
        pass

    def record_test(self, scores: dict[str, float], selected_epoch: int) -> None:
        pass

    def finish(self, result: FinishedRun | None) -> None:
        pass

    def fail(self, err: BaseException) -> None:
        pass
