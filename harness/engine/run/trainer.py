"""The training of one run as an object: a :class:`Trainer` is made from its parts (the
modules and optimizer, the training batches, the step, an evaluator, a checkpointer and a
recorder), trains an epoch, validates and keeps the best epoch, and tests the selected
weights. :meth:`Trainer.from_config` builds those parts for a
:class:`~harness.engine.run.run_config.RunConfig`.

Seeded everywhere (python, numpy, torch; deterministic kernels where they exist, required
with ``--deterministic``, cuDNN autotuning with ``--fast``), AMP (bf16 where supported,
else fp16 with a loss scaler) and channels-last on CUDA, a step loop that reads the device
once per ``[training] sync_every`` steps, and a checkpoint after every epoch from which a
resume continues to exactly the result of an uninterrupted run: every source of
randomness is re-derived from ``(seed, epoch)`` at the start of each epoch (each image's
augmentation from ``(seed, epoch, batch, position)``), so nothing but tensors has to be
saved, and the loader's workers can persist across epochs.

Across processes (:mod:`harness.engine.run.distributed`) each takes a share of every global
batch, the metric loss sees the gathered batch, DDP averages gradients, and process 0
alone evaluates, records and checkpoints.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from harness.base.device import amp_dtype
from harness.base.errors import HarnessError, NonFiniteLoss
from harness.base.metric_keys import metric_key
from harness.components.data import DatasetSplits
from harness.components.evaluation import RETRIEVAL_METRICS, Scores, with_paper_variants
from harness.config.protocol import Protocol
from harness.engine.run.checkpoints import Checkpointer, InMemoryCheckpointer
from harness.engine.run.data import TrainingBatches
from harness.engine.run.distributed import SINGLE_PROCESS, Processes, barrier, check_replicas_agree
from harness.engine.run.embedding import Evaluator, SplitEvaluator
from harness.engine.run.model import (
    EmbeddingModel,
    build_model,
    build_optimizer,
    build_scheduler,
    create_criterion,
    on_device,
)
from harness.engine.run.recorder import FinishedRun, Recorder, StepFlush
from harness.engine.run.run_config import RunConfig
from harness.engine.run.runtime import epoch_seed, log_line, seed_everything
from harness.engine.run.step import TrainingParts, TrainingStep

__all__ = [
    "Trainer",
    "Progress",
    "EpochCallback",
    "EndOfRunStep",
    "StepFunction",
]

CPU = torch.device("cpu")

#: Called after each epoch as ``(epoch, record)`` in process 0; may raise (e.g.
#: ``optuna.TrialPruned``, which stops the run).
EpochCallback = Callable[[int, dict[str, Any]], None]
#: Run by :meth:`Trainer.finish` in process 0 once the selected weights are tested and
#: saved (e.g. log them, export the model, draw explanations).
EndOfRunStep = Callable[[FinishedRun], None]
#: A training step: ``(images, labels, seed, epoch, step) -> (loss, terms)`` on the device
#: (:class:`~harness.engine.run.step.TrainingStep`).
StepFunction = Callable[
    [torch.Tensor, torch.Tensor, int, int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


def _no_best() -> dict[str, Any]:
    return {"epoch": 0, "score": -math.inf, "state": None}


@dataclass
class Progress:
    """Where the epochs stand: the epoch the trainer started from (0, or a checkpoint's),
    the per-epoch records, the best epoch so far (its score and weights), and the next
    epoch to train."""

    start_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=_no_best)
    next_epoch: int = -1  # -1: start_epoch

    def __post_init__(self) -> None:
        if self.next_epoch < 0:
            self.next_epoch = self.start_epoch


@dataclass
class Trainer:
    """One run's training, made from its parts: the ``protocol`` it follows (epochs,
    selection, evaluation, sync interval), the ``parts`` it trains, its training
    ``batches``, the ``step`` that trains one batch, the ``evaluator`` that scores the model
    on validation and test, the ``checkpointer`` each epoch's state goes to and the
    ``recorder`` its results go to.

    :meth:`fit` runs the epochs (:meth:`run_epoch`: :meth:`train_epoch`,
    :meth:`validate_and_select`, the record and the checkpoint), :meth:`load_selected_weights`,
    :meth:`test` and :meth:`finish` (the selected weights to the checkpointer, then the
    ``end_of_run`` steps) end the run; :meth:`resume` continues after a checkpoint.
    :meth:`from_config` builds every part for a run's configuration."""

    protocol: Protocol
    parts: TrainingParts
    batches: TrainingBatches
    step: StepFunction
    evaluator: Evaluator
    recorder: Recorder
    checkpointer: Checkpointer = field(default_factory=InMemoryCheckpointer)
    seed: int = 0
    #: The method and loss names, in progress lines and errors.
    method: str = ""
    loss_name: str = ""
    device: torch.device = CPU
    procs: Processes = SINGLE_PROCESS
    #: Train no epoch: the model's weights (those of ``init_selected_epoch``) are the run's.
    evaluate_only: bool = False
    #: The selected epoch of the run whose weights the model starts from (0: none).
    init_selected_epoch: int = 0
    on_epoch: EpochCallback | None = None
    #: The steps of the finished run, in order (:meth:`finish`).
    end_of_run: list[EndOfRunStep] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        splits: DatasetSplits,
        *,
        recorder: Recorder,
        checkpointer: Checkpointer | None = None,
        evaluator: Evaluator | None = None,
        model: EmbeddingModel | None = None,
        init_selected_epoch: int = 0,
        device: torch.device = CPU,
        workers: int = 0,
        procs: Processes = SINGLE_PROCESS,
        on_epoch: EpochCallback | None = None,
        end_of_run: list[EndOfRunStep] | None = None,
    ) -> Trainer:
        """The trainer of ``cfg`` on ``splits``: the loss module, optimizer, schedule,
        batches and step of its protocol, around ``model`` (already on ``device``, with the
        weights of ``init_selected_epoch``: the caller seeded before building it) or, when
        None, a fresh model built after seeding. ``evaluator``: default a
        :class:`~harness.engine.run.embedding.SplitEvaluator` of ``splits``; ``checkpointer``:
        default an :class:`~harness.engine.run.checkpoints.InMemoryCheckpointer`."""
        protocol = cfg.protocol
        if model is None:
            seed_everything(cfg.seed)
            model = on_device(build_model(protocol, cfg.method, cfg.method_options), device)
        parts, batches, step = _training_parts(cfg, splits, model, device, workers, procs)
        return cls(
            protocol,
            parts,
            batches,
            step,
            evaluator or SplitEvaluator(splits, protocol, cfg.dataset, device, workers),
            recorder,
            checkpointer or InMemoryCheckpointer(),
            seed=cfg.seed,
            method=cfg.method,
            loss_name=cfg.loss,
            device=device,
            procs=procs,
            evaluate_only=cfg.evaluate_only,
            init_selected_epoch=init_selected_epoch,
            on_epoch=on_epoch,
            end_of_run=list(end_of_run or []),
        )

    @property
    def model(self) -> EmbeddingModel:
        return self.parts.model

    @property
    def epochs(self) -> int:
        """The epochs the run trains: the protocol's, none for an evaluate-only run."""
        return 0 if self.evaluate_only else self.protocol.schedule.epochs

    # ----------------------------------------------------------------- state

    def checkpoint(self, epoch: int) -> dict[str, Any]:
        """What a resume after ``epoch`` continues from (live tensors, not copies)."""
        return {
            "epoch": epoch,
            **self.parts.state(),
            "history": self.progress.history,
            "best": self.progress.best,
        }

    def resume(self, checkpoint: dict[str, Any]) -> None:
        """Continue after the checkpoint's epoch: its weights, optimizer state and progress
        (a checkpoint of :meth:`checkpoint`, as the checkpointer's ``load`` returns it)."""
        self.parts.restore(checkpoint)
        self.progress = Progress(
            checkpoint["epoch"], list(checkpoint["history"]), dict(checkpoint["best"])
        )

    # ---------------------------------------------------------------- epochs

    def fit(self, until: int | None = None) -> None:
        """The epochs from where the progress stands to epoch ``until`` (default: the
        protocol's last)."""
        last = self.epochs if until is None else min(until, self.epochs)
        for epoch in range(self.progress.next_epoch, last):
            self.run_epoch(epoch)
            self.progress.next_epoch = epoch + 1

    def run_epoch(self, epoch: int) -> None:
        """Train, step the schedule; in process 0 evaluate on the selection split when due
        (keeping the best weights), print a line, record the epoch and save its checkpoint
        while the other processes wait; then ``on_epoch`` (which may raise)."""
        summary = self.train_epoch(epoch)
        record = {"epoch": epoch + 1, **_epoch_metrics(summary, self.device)}
        self.parts.scheduler.step()
        check_replicas_agree(self.model, self.procs, f"after epoch {epoch + 1}")
        if self.procs.is_main:
            record.update(self.validate_and_select(epoch))
            self.progress.history.append(record)
            log_line(_epoch_line(self, record))
            self.recorder.record_epoch(record)
            self.checkpointer.save(self.checkpoint(epoch + 1))
        barrier(self.procs)  # the other processes wait for this epoch's evaluation and checkpoint
        if self.procs.is_main and self.on_epoch is not None:
            self.on_epoch(epoch + 1, record)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """One epoch, one batch's trip per turn of the loop: draw it from the loader, move it
        to the device, :meth:`train_step`, tally its loss on the device
        (:class:`_StepTally`), and every ``[training] sync_every`` steps and at the end read
        the tally once and log it (a :class:`StepFlush` to the recorder,
        :class:`_EpochMeter`), where a non-finite loss stops the run and names its first
        batch. Returns the epoch's mean loss (``train_loss``, ``train_loss_<term>``),
        throughput and seconds."""
        torch.manual_seed(
            epoch_seed(self.seed, epoch)
        )  # dropout (miners: per step, augmentation: per image)
        self.batches.sampler.set_epoch(epoch)
        self.parts.model.train()
        sync_every = self.protocol.training.sync_every
        tally, meter = _StepTally(sync_every, self.device), _EpochMeter(self, epoch)
        bar = tqdm(
            self.batches.loader,
            desc=f"{self.method} epoch {epoch + 1}/{self.epochs}",
            unit="batch",
            leave=False,
            disable=None,
            file=sys.stderr,
        )
        step = -1
        for step, (images, labels, _) in enumerate(bar):
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            try:
                loss, terms = self.train_step(images, labels, epoch, step)
            except Exception:
                # Weights a non-finite loss has reached can make a later step fail another way
                # (a miner on NaN distances): the first non-finite batch is the error to report.
                if tally.filled:
                    meter.log(tally, step - 1, bar)
                raise
            tally.add(loss, terms, len(images))
            meter.seen += len(images)
            if tally.filled == sync_every:
                meter.log(tally, step, bar)
        if tally.filled:
            meter.log(tally, step, bar)
        return meter.summary()

    def train_step(
        self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One batch through :attr:`step`; returns the loss and its terms, on the device."""
        return self.step(images, labels, self.seed, epoch, step)

    # ------------------------------------------------------ selection, test

    def validate_and_select(self, epoch: int) -> dict[str, float]:
        """When the protocol's selection evaluates after ``epoch``: the retrieval metrics on
        its split under their logged keys (``val/*``, or ``paper_selection/*`` for selection
        on the test set), the weights kept when the selection metric is the best so far."""
        selection = self.protocol.selection
        if selection.mode not in ("validation", "test-paper") or not selection.due(
            epoch + 1, self.epochs
        ):
            return {}
        split, group = (
            ("val", "val") if selection.mode == "validation" else ("test", "paper_selection")
        )
        scores = self.evaluator(self.model, split, metrics=_selection_metrics(self.protocol))
        if scores[selection.metric] > self.progress.best["score"]:
            self.progress.best = {
                "epoch": epoch + 1,
                "score": float(scores[selection.metric]),
                "state": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            }
        return {metric_key(group, k): v for k, v in scores.items()}

    def load_selected_weights(self) -> int:
        """Load the selected epoch's weights into the model; returns that epoch (for an
        evaluate-only run, the epoch its base run selected: those are the weights it has)."""
        selection = self.protocol.selection
        if self.evaluate_only:
            return self.init_selected_epoch
        if selection.mode == "last":
            return self.epochs
        best = self.progress.best
        if best["state"] is None and self.epochs > self.progress.start_epoch:
            raise HarnessError(
                f"the selection metric {selection.metric} was NaN at every evaluation "
                f"(selection mode '{selection.mode}'), so no epoch could be selected; "
                f"does every validation class have at least two images?"
            )
        if best["state"] is not None:
            self.model.load_state_dict(best["state"])
        return best["epoch"]

    def test(self, selected_epoch: int) -> Scores:
        """The model's weights (those of ``selected_epoch``) on the test split, recorded.
        The papers' metric variants ride along (not protocol settings), and the per-query
        values behind every retrieval mean are kept for intervals and paired tests."""
        metrics = with_paper_variants(self.protocol.evaluation.metrics)
        scores = self.evaluator(self.model, "test", metrics=metrics, per_query=True)
        self.recorder.record_test(scores, selected_epoch)
        return scores

    def finish(self, selected_epoch: int, test: dict[str, float]) -> FinishedRun:
        """The tested weights of ``selected_epoch`` to the checkpointer, then each
        ``end_of_run`` step on the finished run; returns it."""
        weights = {
            "model": self.model.state_dict(),
            "method": self.method,
            "selected_epoch": selected_epoch,
        }
        finished = FinishedRun(
            self.model, selected_epoch, test, self.checkpointer.save_selected(weights)
        )
        for step in self.end_of_run:
            step(finished)
        return finished


def _training_parts(
    cfg: RunConfig,
    splits: DatasetSplits,
    model: EmbeddingModel,
    device: torch.device,
    workers: int,
    procs: Processes,
) -> tuple[TrainingParts, TrainingBatches, TrainingStep]:
    """The criterion (the loss module), optimizer, schedule and loss scaler around
    ``model``, the batches of ``splits.train`` and the step of ``cfg`` (compiled in one
    process under ``compile``), built in this order (the order of the random draws they
    make)."""
    protocol = cfg.protocol
    num_classes = len(np.unique(splits.train.labels))
    criterion = create_criterion(model.head, cfg.loss, cfg.loss_args, num_classes=num_classes).to(
        device
    )
    optimizer = build_optimizer(protocol, model, criterion)
    batches = TrainingBatches.build(
        protocol,
        splits,
        seed=cfg.seed,
        device=device,
        workers=workers,
        procs=procs,
        loss_name=cfg.loss,
    )
    dtype = amp_dtype(device, protocol.numerics.precision)
    # A loss scaler only for float16 autocast (bfloat16 has float32's range).
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    parts = TrainingParts(model, criterion, optimizer, build_scheduler(protocol, optimizer), scaler)
    step = TrainingStep.build(
        protocol,
        cfg.loss,
        parts,
        device=device,
        procs=procs,
        autocast_dtype=dtype,
        compile=cfg.settings.compile,
    )
    if cfg.settings.compile and not procs.distributed:
        step.compile(cuda_graphs=cfg.settings.cuda_graphs)
    return parts, batches, step


def _selection_metrics(protocol: Protocol) -> tuple[str, ...]:
    """Per-epoch selection needs the retrieval metrics only (no k-means every epoch)."""
    wanted = [
        m for m in protocol.evaluation.metrics if m in RETRIEVAL_METRICS or m == "recall_at_k"
    ]
    return tuple(dict.fromkeys([*wanted, protocol.selection.metric]))


class _StepTally:
    """The loop's running values, kept on the device: each step's loss in a window of
    ``sync_every`` slots, and the epoch's sums of every loss term times its batch size.
    Writing them queues device work only; :meth:`read` is the one transfer to the host."""

    def __init__(self, sync_every: int, device: torch.device):
        self.window = torch.zeros(sync_every, device=device)
        self.filled = 0
        self.sums: dict[str, torch.Tensor] = {}  # "" is the total

    def add(self, loss: torch.Tensor, terms: dict[str, torch.Tensor], batch_size: int) -> None:
        self.window[self.filled] = loss.detach().float()  # an indexed copy: no sync
        self.filled += 1
        for name, value in (("", loss), *terms.items()):
            value = value.detach().float() * batch_size
            self.sums[name] = self.sums[name] + value if name in self.sums else value

    def read(self) -> tuple[list[float], dict[str, float]]:
        """The window's losses and the sums, in one device-to-host transfer; the window empties."""
        names = list(self.sums)
        values = torch.cat(
            [self.window[: self.filled], *(self.sums[n].reshape(1) for n in names)]
        ).tolist()
        losses, sums = values[: self.filled], dict(zip(names, values[self.filled :], strict=True))
        self.filled = 0
        return losses, sums


class _EpochMeter:
    """One epoch's running account on the host: the images seen, the time, the sums last
    read from the tally; :meth:`log` reads the tally and hands it to the recorder."""

    def __init__(self, trainer: Trainer, epoch: int):
        self.trainer, self.epoch = trainer, epoch
        self.steps_before = epoch * len(trainer.batches.sampler)
        self.seen, self.started = 0, time.perf_counter()
        self.sums: dict[str, float] = {}

    def log(self, tally: _StepTally, step: int, bar: tqdm) -> None:
        """The one host sync: read steps ``step - filled + 1 .. step`` from ``tally``, raise
        on a non-finite loss, show the running loss on ``bar`` and record the flush."""
        first = step - tally.filled + 1
        losses, self.sums = tally.read()
        bad = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
        trainer = self.trainer
        if bad is not None:
            raise NonFiniteLoss(
                f"loss is {losses[bad]} at epoch {self.epoch + 1}, batch {first + bad + 1} "
                f"(method '{trainer.method}', loss '{trainer.loss_name}'); run stopped and marked FAILED"
            )
        bar.set_postfix(
            loss=f"{self.sums.get('', 0.0) / max(self.seen, 1):.4f}",
            img_s=f"{self.seen / (time.perf_counter() - self.started):.0f}",
        )
        lr = float(trainer.parts.optimizer.param_groups[0]["lr"])
        trainer.recorder.record_flush(
            StepFlush(
                self.epoch + 1,
                self.steps_before + step + 1,
                tuple(losses),
                lr,
                dict(self.sums),
                self.seen,
            )
        )

    def summary(self) -> dict[str, float]:
        """The epoch's mean loss and terms, throughput and seconds."""
        elapsed = time.perf_counter() - self.started
        totals = {k: v / max(self.seen, 1) for k, v in self.sums.items()}
        return {
            "train_loss": totals.pop("", 0.0),
            "train_images_per_s": self.seen / max(elapsed, 1e-9),
            "train_seconds": elapsed,
            **{f"train_loss_{k}": v for k, v in totals.items()},
        }


def _epoch_metrics(summary: dict[str, float], device: torch.device) -> dict[str, float]:
    """An epoch's training summary under its logged keys: the mean loss and its terms as
    ``train/epoch_loss*`` (``train/loss`` is the per-step curve), throughput, time and
    peak memory as ``system/*``."""
    system = {"train_images_per_s": "train_images_per_s", "train_seconds": "train_epoch_seconds"}
    record = {}
    for name, value in summary.items():  # train_loss, train_loss_<term>, throughput, seconds
        key = (
            metric_key("system", system[name])
            if name in system
            else metric_key("train", "epoch_" + name.removeprefix("train_"))
        )
        record[key] = value
    # ru_maxrss is in KiB on Linux: the process's peak resident memory so far.
    record[metric_key("system", "max_rss_mb")] = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    if device.type == "cuda":
        record[metric_key("system", "cuda_max_allocated_mb")] = (
            torch.cuda.max_memory_allocated(device) / 2**20
        )
    return record


def _epoch_line(trainer: Trainer, record: dict) -> str:
    metric = trainer.protocol.selection.metric
    parts = [
        f"{trainer.method:>12s} seed {trainer.seed} epoch {record['epoch']}/{trainer.epochs}",
        f"loss {record[metric_key('train', 'epoch_loss')]:.4f}",
        f"{record[metric_key('system', 'train_images_per_s')]:.0f} img/s",
    ]
    for group in ("val", "paper_selection"):
        if metric_key(group, metric) in record:
            parts.append(f"{group} {metric} {record[metric_key(group, metric)]:.4f}")
    return "  ".join(parts)
