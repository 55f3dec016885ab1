"""The training of one run as an object: a :class:`Trainer` builds what the run trains
with, trains an epoch, validates and keeps the best epoch, and tests the selected
weights, reporting to the :class:`~harness.engine.recorder.Recorder` it is given.

Seeded everywhere (python, numpy, torch; deterministic kernels where they exist, required
with ``--deterministic``, cuDNN autotuning with ``--fast``), AMP (bf16 where supported,
else fp16 with a loss scaler) and channels-last on CUDA, a step loop that reads the device
once per ``[training] sync_every`` steps, and a checkpoint after every epoch from which a
resume continues to exactly the result of an uninterrupted run: every source of
randomness is re-derived from ``(seed, epoch)`` at the start of each epoch (each image's
augmentation from ``(seed, epoch, batch, position)``), so nothing but tensors has to be
saved, and the loader's workers can persist across epochs.

Across processes (:mod:`harness.engine.distributed`) each takes a share of every global
batch, the metric loss sees the gathered batch, DDP averages gradients, and process 0
alone evaluates and records.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from harness.base.device import amp_dtype
from harness.base.errors import HarnessError, NonFiniteLoss
from harness.base.faults import fault_point
from harness.base.metric_keys import metric_key
from harness.components.data import DatasetSplits
from harness.components.data.transforms import normalize_batch
from harness.components.evaluation import RETRIEVAL_METRICS, Scores, with_paper_variants
from harness.components.gradients import clip_gradients
from harness.components.losses import MetricLoss, step_seed
from harness.config.protocol import Protocol
from harness.engine.compiled_step import (
    CompiledStep,
    compile_step,
    forward_then_backward,
    step_modules,
)
from harness.engine.data import TrainingBatches
from harness.engine.distributed import (
    SINGLE_PROCESS,
    GatheredMetricLoss,
    Processes,
    average_gradients,
    barrier,
    check_replicas_agree,
)
from harness.engine.embedding import evaluate_split
from harness.engine.model import (
    EmbeddingModel,
    build_model,
    build_optimizer,
    build_scheduler,
    create_loss_module,
)
from harness.engine.recorder import Recorder, StepFlush
from harness.engine.run_config import RunConfig
from harness.engine.runtime import epoch_seed, log_line, seed_everything
from harness.methods import TrainingBatch
from harness.store.weights import load_finished_weights

__all__ = ["Trainer", "TrainingParts", "Progress"]

CPU = torch.device("cpu")


@dataclass
class TrainingParts:
    """The modules and optimizer state a run trains: what a checkpoint saves and a resume
    restores."""

    model: EmbeddingModel
    loss_fn: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "loss": self.loss_fn.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }  # AMP's loss scale: a resume continues it

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.loss_fn.load_state_dict(checkpoint["loss"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if checkpoint.get("scaler"):  # absent in older checkpoints; empty when AMP is off
            self.scaler.load_state_dict(checkpoint["scaler"])


def _no_best() -> dict[str, Any]:
    return {"epoch": 0, "score": -math.inf, "state": None}


@dataclass
class Progress:
    """Where the epochs stand: the next epoch, the per-epoch records, and the best epoch
    so far (its score and weights)."""

    start_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=_no_best)


@dataclass
class Trainer:
    """One run's training: its configuration, data, modules, progress and recorder.

    Made by :meth:`build`; :meth:`fit` runs the epochs (:meth:`run_epoch`: :meth:`train_epoch`,
    :meth:`validate_and_select`, the record), :meth:`load_selected_weights` and :meth:`test`
    finish the run."""

    cfg: RunConfig
    splits: DatasetSplits
    parts: TrainingParts
    batches: TrainingBatches
    #: The module a training step calls: the model, or DDP (and ``torch.compile``) around it.
    train_model: nn.Module
    metric_loss: MetricLoss
    recorder: Recorder
    device: torch.device = CPU
    procs: Processes = SINGLE_PROCESS
    #: Data-loading processes of the training loader and of each evaluation.
    workers: int = 0
    fingerprint: str = ""
    #: The selected epoch of the ``init_from`` run whose weights the model starts from.
    init_selected_epoch: int = 0
    #: The autocast dtype of the training step (:func:`~harness.base.device.amp_dtype`), None: none.
    autocast_dtype: torch.dtype | None = None
    progress: Progress = field(default_factory=Progress)
    #: The step's two halves compiled (``--compile``, single process), or None: eager.
    compiled: CompiledStep | None = None

    @classmethod
    def build(
        cls,
        cfg: RunConfig,
        splits: DatasetSplits,
        *,
        recorder: Recorder,
        device: torch.device = CPU,
        workers: int = 0,
        procs: Processes = SINGLE_PROCESS,
        fingerprint: str = "",
    ) -> Trainer:
        """Seed, then build the model (from ``cfg.init_from``'s weights when given, which
        must carry ``fingerprint`` for an evaluate-only run), the loss, optimizer, batches,
        miner and schedule of ``cfg`` on ``splits``."""
        protocol = cfg.protocol
        seed_everything(cfg.seed)
        model, init_selected_epoch = _initial_model(cfg, device, fingerprint)
        num_classes = len(np.unique(splits.train.labels))
        loss_fn = create_loss_module(
            model.head, cfg.loss, cfg.loss_args, num_classes=num_classes
        ).to(device)
        optimizer = build_optimizer(protocol, model, loss_fn)
        batches = TrainingBatches.build(
            protocol,
            splits,
            seed=cfg.seed,
            device=device,
            workers=workers,
            procs=procs,
            loss=cfg.loss,
        )
        train_model, metric_loss = step_modules(cfg, model, loss_fn, device, procs)
        dtype = amp_dtype(device, protocol.numerics.precision)
        # A loss scaler only for float16 autocast (bfloat16 has float32's range).
        scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        parts = TrainingParts(
            model, loss_fn, optimizer, build_scheduler(protocol, optimizer), scaler
        )
        trainer = cls(
            cfg,
            splits,
            parts,
            batches,
            train_model,
            metric_loss,
            recorder,
            device=device,
            procs=procs,
            workers=workers,
            fingerprint=fingerprint,
            init_selected_epoch=init_selected_epoch,
            autocast_dtype=dtype,
        )
        if (cfg.compile or cfg.cuda_graphs) and not procs.distributed:
            trainer.compile_step()
        return trainer

    def compile_step(self, **backends: Any) -> None:
        """Compile the step (:func:`~harness.engine.compiled_step.compile_step`, with its
        ``backend`` and ``optimizer_backend`` when given), saying why where it has graph
        breaks. In one process only: across processes ``--compile`` compiles the model inside
        DDP (:func:`~harness.engine.compiled_step.step_modules`)."""
        self.compiled = compile_step(
            self.forward_loss,
            self.backward,
            self.optimizer_step,
            head=self.model.head,
            miner=self.metric_loss.miner,
            device=self.device,
            dtype=self.autocast_dtype,
            cuda_graphs=self.cfg.cuda_graphs,
            **backends,
        )
        if self.compiled.breaks_because:
            log_line(
                f"compile: the step compiles with graph breaks: {self.compiled.breaks_because}"
            )

    @property
    def model(self) -> EmbeddingModel:
        return self.parts.model

    @property
    def epochs(self) -> int:
        """The epochs the run trains: the protocol's, none for an evaluate-only run."""
        return 0 if self.cfg.evaluate_only else self.cfg.protocol.schedule.epochs

    # ----------------------------------------------------------------- state

    def checkpoint(self, epoch: int) -> dict[str, Any]:
        """What a resume after ``epoch`` continues from (live tensors, not copies)."""
        return {
            "epoch": epoch,
            **self.parts.state(),
            "history": self.progress.history,
            "best": self.progress.best,
            "fingerprint": self.fingerprint,
        }

    def resume(self, checkpoint: dict[str, Any]) -> None:
        """Continue after the checkpoint's epoch: its weights, optimizer state and progress."""
        self.parts.restore(checkpoint)
        self.progress = Progress(
            checkpoint["epoch"], list(checkpoint["history"]), dict(checkpoint["best"])
        )

    # ---------------------------------------------------------------- epochs

    def fit(self) -> None:
        """The epochs from where the progress stands to the protocol's last."""
        for epoch in range(self.progress.start_epoch, self.epochs):
            self.run_epoch(epoch)

    def run_epoch(self, epoch: int) -> None:
        """Train, step the schedule; in process 0 evaluate on the selection split when due
        (keeping the best weights), print a line and record the epoch with its checkpoint
        while the other processes wait; then ``cfg.epoch_callback`` (which may raise)."""
        summary = self.train_epoch(epoch)
        record = {"epoch": epoch + 1, **_epoch_metrics(summary, self.device)}
        self.parts.scheduler.step()
        check_replicas_agree(self.model, self.procs, f"after epoch {epoch + 1}")
        if self.procs.is_main:
            record.update(self.validate_and_select(epoch))
            self.progress.history.append(record)
            log_line(_epoch_line(self.cfg, record, self.epochs, self.cfg.protocol.selection.metric))
            self.recorder.record_epoch(record, self.checkpoint(epoch + 1))
        barrier(self.procs)  # the other processes wait for this epoch's evaluation and checkpoint
        if self.procs.is_main and self.cfg.epoch_callback is not None:
            self.cfg.epoch_callback(epoch + 1, record)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """One epoch of :meth:`train_step`, queued without waiting on the device: each step's
        loss and the epoch's sums stay on the device (:class:`_StepTally`) and are read every
        ``[training] sync_every`` steps and at the end (a :class:`StepFlush` to the recorder),
        where a non-finite loss stops the run and names its first batch. Returns the epoch's
        mean loss (``train_loss``, ``train_loss_<term>``), throughput and seconds."""
        torch.manual_seed(
            epoch_seed(self.cfg.seed, epoch)
        )  # dropout (miners: per step, augmentation: per image)
        self.batches.sampler.set_epoch(epoch)
        self.train_model.train()
        meter = _EpochMeter(self, epoch)
        step = -1
        for step, (images, labels, _) in enumerate(meter.bar):
            try:
                loss, terms = self.train_step(images, labels, epoch, step)
            except Exception:
                # Weights a non-finite loss has reached can make a later step fail another way
                # (a miner on NaN distances): the first non-finite batch is the error to report.
                meter.flush_pending(step - 1)
                raise
            fault_point("train_batch")  # test-only hook (harness.base.faults); nothing when unset
            meter.add(loss, terms, len(images), step)
        return meter.finish(step)

    def train_step(
        self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward, the head's loss terms, backward and the optimizer step of one batch;
        returns the loss and its terms, on the device."""
        images = normalize_batch(images.to(self.device, non_blocking=True), self.cfg.protocol.image)
        labels = labels.to(self.device, non_blocking=True)
        images = images.contiguous(memory_format=torch.channels_last)  # as the model (every device)
        self.parts.optimizer.zero_grad(set_to_none=True)
        if self.compiled is not None:
            # The draws inside the graph (mining, dropout) from the step's own seed.
            torch.manual_seed(step_seed(self.cfg.seed, epoch, step))
            loss, terms = self.compiled.forward_backward(images, labels)
            self.compiled.optimizer_step()
            return loss, terms
        # Random mining seeded per step and call (losses.MetricLoss).
        self.metric_loss.set_step(self.cfg.seed, epoch, step)
        loss, terms = self.forward_backward(images, labels)
        self.optimizer_step()
        return loss, terms

    def forward_backward(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`forward_loss` and :meth:`backward` (gradients accumulate into cleared
        ``.grad``); returns the loss and its terms, detached."""
        return forward_then_backward(self.forward_loss, self.backward, images, labels)

    def forward_loss(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The model's forward on a normalised batch under autocast and the head's loss terms."""
        parts, dtype = self.parts, self.autocast_dtype
        with torch.autocast(device_type=self.device.type, dtype=dtype, enabled=dtype is not None):
            out = self.train_model(images)
            terms = parts.model.head.loss_terms(
                out, TrainingBatch(labels, self.metric_loss, images, parts.model)
            )
            return cast(torch.Tensor, sum(terms.values())), terms

    def backward(self, loss: torch.Tensor) -> None:
        """The backward, through float16's loss scaler (on for float16 alone; Dynamo does not
        trace ``GradScaler``)."""
        (self.parts.scaler.scale(loss) if self.autocast_dtype == torch.float16 else loss).backward()

    def optimizer_step(self) -> None:
        """The loss's own gradients averaged across processes, clipping, the update."""
        parts = self.parts
        if isinstance(self.metric_loss, GatheredMetricLoss):
            average_gradients(parts.loss_fn.parameters(), self.procs)
        clip_gradients(parts.optimizer, self.cfg.protocol.optimizer.clip_grad_norm, parts.scaler)
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()

    # ------------------------------------------------------ selection, test

    def validate_and_select(self, epoch: int) -> dict[str, float]:
        """When the protocol's selection evaluates after ``epoch``: the retrieval metrics on
        its split under their logged keys (``val/*``, or ``paper_selection/*`` for selection
        on the test set), the weights kept when the selection metric is the best so far."""
        selection = self.cfg.protocol.selection
        due = (epoch + 1) % selection.evaluate_every == 0 or epoch + 1 == self.epochs
        if selection.mode not in ("validation", "test-paper") or not due:
            return {}
        if selection.mode == "validation":
            queries, gallery, group = self.splits.val, None, "val"
        else:
            queries, gallery, group = self.splits.test, self.splits.gallery, "paper_selection"
        scores = evaluate_split(
            self.model,
            queries,
            gallery,
            self.cfg.protocol,
            self.cfg.dataset,
            device=self.device,
            workers=self.workers,
            metrics=_selection_metrics(self.cfg.protocol),
        )
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
        selection = self.cfg.protocol.selection
        if self.cfg.evaluate_only:
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
        protocol = self.cfg.protocol
        scores = evaluate_split(
            self.model,
            self.splits.test,
            self.splits.gallery,
            protocol,
            self.cfg.dataset,
            device=self.device,
            workers=self.workers,
            metrics=with_paper_variants(protocol.evaluation.metrics),
            per_query=True,
        )
        self.recorder.record_test(scores, selected_epoch)
        return scores


def _initial_model(
    cfg: RunConfig, device: torch.device, fingerprint: str
) -> tuple[EmbeddingModel, int]:
    """The run's model on ``device`` and the epoch its weights come from (0: fresh ones;
    else the selected epoch of ``cfg.init_from``)."""
    model = build_model(cfg.protocol, cfg.method, cfg.method_options)
    init_selected_epoch = 0
    if cfg.init_from:
        init_selected_epoch = load_finished_weights(
            model,
            cfg.init_from,
            flag="--init-from",
            checkpoint_root=cfg.checkpoint_root,
            expect_fingerprint=fingerprint if cfg.evaluate_only else "",
        )
    # Channels-last on every device: cuDNN's tensor-core kernels want it, and oneDNN's CPU
    # convolutions (depthwise ones above all) run 10-15% faster with it on the smoke protocol.
    return model.to(device, memory_format=torch.channels_last), init_selected_epoch  # type: ignore[call-overload]  # torch's stubs lack Module.to(device, memory_format=...), which it accepts


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
    """One epoch's running account: the device-side tally, the images seen, the progress
    bar over the loader, and the flushes that read the tally and hand it to the recorder."""

    def __init__(self, trainer: Trainer, epoch: int):
        self.trainer, self.epoch = trainer, epoch
        self.sync_every = trainer.cfg.protocol.training.sync_every
        self.steps_before = epoch * len(trainer.batches.sampler)
        self.seen, self.started = 0, time.perf_counter()
        self.tally = _StepTally(self.sync_every, trainer.device)
        self.sums: dict[str, float] = {}
        self.bar = tqdm(
            trainer.batches.loader,
            desc=f"{trainer.cfg.method} epoch {epoch + 1}/{trainer.epochs}",
            unit="batch",
            leave=False,
            disable=None,
            file=sys.stderr,
        )

    def add(
        self, loss: torch.Tensor, terms: dict[str, torch.Tensor], batch_size: int, step: int
    ) -> None:
        """Step ``step``'s loss and terms; a flush when the window is full."""
        self.tally.add(loss, terms, batch_size)
        self.seen += batch_size
        if self.tally.filled == self.sync_every:
            self.flush(step)

    def flush_pending(self, step: int) -> None:
        """Flush the steps not yet read, the last of them ``step``."""
        if self.tally.filled:
            self.flush(step)

    def flush(self, step: int) -> None:
        """The one host sync: read steps ``step - filled + 1 .. step``, raise on a non-finite loss."""
        first = step - self.tally.filled + 1
        losses, self.sums = self.tally.read()
        bad = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
        cfg = self.trainer.cfg
        if bad is not None:
            raise NonFiniteLoss(
                f"loss is {losses[bad]} at epoch {self.epoch + 1}, batch {first + bad + 1} "
                f"(method '{cfg.method}', loss '{cfg.loss}'); run stopped and marked FAILED"
            )
        self.bar.set_postfix(
            loss=f"{self.sums.get('', 0.0) / max(self.seen, 1):.4f}",
            img_s=f"{self.seen / (time.perf_counter() - self.started):.0f}",
        )
        lr = float(self.trainer.parts.optimizer.param_groups[0]["lr"])
        self.trainer.recorder.record_flush(
            StepFlush(
                self.epoch + 1,
                self.steps_before + step + 1,
                tuple(losses),
                lr,
                dict(self.sums),
                self.seen,
            )
        )

    def finish(self, step: int) -> dict[str, float]:
        """The last flush, then the epoch's mean loss and terms, throughput and seconds."""
        self.flush_pending(step)
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


def _epoch_line(cfg: RunConfig, record: dict, epochs: int, metric: str) -> str:
    parts = [
        f"{cfg.method:>12s} seed {cfg.seed} epoch {record['epoch']}/{epochs}",
        f"loss {record[metric_key('train', 'epoch_loss')]:.4f}",
        f"{record[metric_key('system', 'train_images_per_s')]:.0f} img/s",
    ]
    for group in ("val", "paper_selection"):
        if metric_key(group, metric) in record:
            parts.append(f"{group} {metric} {record[metric_key(group, metric)]:.4f}")
    return "  ".join(parts)
