"""One training step, and the modules it trains with: :class:`TrainingParts` (the model,
the loss module, the optimizer, its schedule and AMP's loss scaler: what a checkpoint
saves) and :class:`TrainingStep` (forward under autocast, the head's loss terms through
the run's :class:`~harness.components.losses.MetricLoss`, backward, clipping, the update),
eager or compiled (:mod:`harness.engine.run.compiled_step`).

:func:`step_modules` builds what the step calls: the run's miner (the protocol's, or its
loss's own), the metric loss handed to the head and, across processes, DDP around the
model (compiled inside DDP under ``--compile``) and the metric loss over the gathered
batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from harness.components.data.transforms import normalize_batch
from harness.components.gradients import clip_gradients, clips_at
from harness.components.losses import MetricLoss, create_miner, miner_for, step_seed
from harness.config.protocol import Protocol
from harness.config.sections import ImageSpec
from harness.engine.run.compiled_step import CompiledStep, compile_step
from harness.engine.run.distributed import (
    SINGLE_PROCESS,
    GatheredMetricLoss,
    Processes,
    average_gradients,
    wrap_model,
)
from harness.engine.run.model import EmbeddingModel
from harness.engine.run.runtime import log_line
from harness.methods import TrainingBatch

__all__ = ["TrainingParts", "TrainingStep", "run_miner", "step_modules"]

CPU = torch.device("cpu")


@dataclass
class TrainingParts:
    """The modules and optimizer state a run trains: what a checkpoint saves and a resume
    restores. ``criterion``: the metric loss's own module (one instance, or a
    ``ModuleList`` of a head's copies), whose parameters (margin betas, proxies) are
    optimised beside the model's."""

    model: EmbeddingModel
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "loss": self.criterion.state_dict(),  # the key checkpoints on disk carry
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }  # AMP's loss scale: a resume continues it

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.criterion.load_state_dict(checkpoint["loss"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if checkpoint.get("scaler"):  # absent in older checkpoints; empty when AMP is off
            self.scaler.load_state_dict(checkpoint["scaler"])


def run_miner(loss_name: str, protocol: Protocol) -> Any:
    """The miner a run of ``loss_name`` uses under ``protocol`` (the protocol's, or the
    loss's own: :func:`~harness.components.losses.miner_for`)."""
    return create_miner(
        *miner_for(
            loss_name, protocol.miner.name, protocol.miner.args, loss_miners=protocol.loss.miners
        )
    )


def step_modules(
    protocol: Protocol,
    loss_name: str,
    parts: TrainingParts,
    *,
    device: torch.device = CPU,
    procs: Processes = SINGLE_PROCESS,
    compile: bool = False,
) -> tuple[nn.Module, MetricLoss]:
    """The module a training step calls and the metric loss it hands the head, with the
    run's miner (:func:`run_miner`): across processes DDP and the loss over the gathered
    batch, and under ``compile`` the model compiled inside DDP (in one process the step
    compiles itself, :meth:`TrainingStep.compile`)."""
    miner = run_miner(loss_name, protocol)
    if not procs.distributed:
        return parts.model, MetricLoss(parts.criterion, miner)
    train_model: nn.Module = wrap_model(parts.model, device)
    if compile:
        train_model = cast(nn.Module, torch.compile(train_model))  # an OptimizedModule
    return train_model, GatheredMetricLoss(parts.criterion, miner, procs)


@dataclass
class TrainingStep:
    """One batch's forward, loss terms, backward and update on :attr:`parts`.

    ``train_model``: the module the step calls (the model, or DDP around it);
    ``metric_loss``: the per-step caller of the loss module with the run's miner, handed
    to the head (:class:`~harness.methods.TrainingBatch`); ``image``: the normalisation of
    the batches; ``autocast_dtype``: the forward's autocast (None: none; float16 goes
    through the loss scaler); ``compiled``: the step's two halves compiled, or None: eager."""

    parts: TrainingParts
    train_model: nn.Module
    metric_loss: MetricLoss
    image: ImageSpec
    clip_grad_norm: float = 0.0
    #: ``every`` step clips, or the run's ``first`` alone (``optimizer.clip_steps``).
    clip_steps: str = "every"
    device: torch.device = CPU
    procs: Processes = SINGLE_PROCESS
    autocast_dtype: torch.dtype | None = None
    compiled: CompiledStep | None = None
    #: Whether this step clips (set per step from ``clip_steps``).
    clipping: bool = field(default=True, init=False)

    @classmethod
    def build(
        cls,
        protocol: Protocol,
        loss_name: str,
        parts: TrainingParts,
        *,
        device: torch.device = CPU,
        procs: Processes = SINGLE_PROCESS,
        autocast_dtype: torch.dtype | None = None,
        compile: bool = False,
    ) -> TrainingStep:
        """The step of a run of ``loss_name`` under ``protocol`` (:func:`step_modules`)."""
        train_model, metric_loss = step_modules(
            protocol, loss_name, parts, device=device, procs=procs, compile=compile
        )
        return cls(
            parts,
            train_model,
            metric_loss,
            protocol.image,
            protocol.optimizer.clip_grad_norm,
            protocol.optimizer.clip_steps,
            device=device,
            procs=procs,
            autocast_dtype=autocast_dtype,
        )

    def compile(self, *, cuda_graphs: bool = False, **backends: Any) -> None:
        """Compile the step (:func:`~harness.engine.run.compiled_step.compile_step`, with its
        ``backend`` and ``optimizer_backend`` when given), saying why where it has graph
        breaks. In one process only: across processes ``--compile`` compiles the model inside
        DDP (:func:`step_modules`)."""
        self.compiled = compile_step(
            self.forward_loss,
            self.backward,
            self.optimizer_step,
            head=self.parts.model.head,
            miner=self.metric_loss.miner,
            device=self.device,
            dtype=self.autocast_dtype,
            cuda_graphs=cuda_graphs,
            **backends,
        )
        if self.compiled.breaks_because:
            log_line(
                f"compile: the step compiles with graph breaks: {self.compiled.breaks_because}"
            )

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, seed: int, epoch: int, step: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Step ``step`` of ``epoch`` of the run ``seed`` on one batch; returns the loss
        and its terms, on the device."""
        images = normalize_batch(images.to(self.device, non_blocking=True), self.image)
        labels = labels.to(self.device, non_blocking=True)
        images = images.contiguous(memory_format=torch.channels_last)  # as the model (every device)
        self.parts.optimizer.zero_grad(set_to_none=True)
        self.clipping = clips_at(self.clip_steps, epoch, step)
        if self.compiled is not None:
            # The draws inside the graph (mining, dropout) from the step's own seed.
            torch.manual_seed(step_seed(seed, epoch, step))
            loss, terms = self.compiled.forward_backward(images, labels)
            self.compiled.optimizer_step()
            return loss, terms
        # Random mining seeded per step and call (losses.MetricLoss).
        self.metric_loss.set_step(seed, epoch, step)
        loss, terms = self.forward_backward(images, labels)
        self.optimizer_step()
        return loss, terms

    def forward_backward(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`forward_loss` and :meth:`backward` (gradients accumulate into cleared
        ``.grad``); returns the loss and its terms, detached."""
        loss, terms = self.forward_loss(images, labels)
        self.backward(loss)
        return loss.detach(), {name: value.detach() for name, value in terms.items()}

    def forward_loss(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The model's forward on a normalised batch under autocast and the head's loss terms."""
        model, dtype = self.parts.model, self.autocast_dtype
        with torch.autocast(device_type=self.device.type, dtype=dtype, enabled=dtype is not None):
            out = self.train_model(images)
            terms = model.head.loss_terms(
                out, TrainingBatch(labels, self.metric_loss, images, model)
            )
            return cast(torch.Tensor, sum(terms.values())), terms

    def backward(self, loss: torch.Tensor) -> None:
        """The backward, through float16's loss scaler (on for float16 alone; Dynamo does not
        trace ``GradScaler``)."""
        (self.parts.scaler.scale(loss) if self.autocast_dtype == torch.float16 else loss).backward()

    def optimizer_step(self) -> None:
        """The loss module's own gradients averaged across processes, clipping, the update."""
        parts = self.parts
        if isinstance(self.metric_loss, GatheredMetricLoss):
            average_gradients(parts.criterion.parameters(), self.procs)
        clip_gradients(parts.optimizer, self.clip_grad_norm if self.clipping else 0.0, parts.scaler)
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()
