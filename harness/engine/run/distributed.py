"""One run across several processes (``torchrun --nproc_per_node=N -m harness run ...``).

The global batch of the protocol is split by classes across the N processes
(:class:`~harness.components.data.sampling.ClassBalancedBatchSampler` with ``rank`` and
``world_size``). Each process embeds its share; the metric loss sees the whole global
batch (:class:`GatheredMetricLoss`), gradients are averaged by
``DistributedDataParallel``, and process 0 alone evaluates, tracks and checkpoints
while the others wait (:func:`barrier`).

Why not pytorch-metric-learning's ``DistributedLossWrapper``: it puts the local
embeddings first in the gathered batch (so each process mines a differently ordered
batch, and random miners draw different tuples on each process), and it multiplies the
whole loss by the world size to undo DDP's averaging, which also multiplies the
gradient of the loss's own parameters (margin beta, proxies) by N. Here every process
concatenates the shares in rank order (the single-process batch), mines with the same
seed, and only the gradient that flows into its own embeddings is scaled by N.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from harness.base.errors import HarnessError
from harness.components.losses.metric_loss import _MINE, MetricLoss
from harness.components.losses.mined import apply_loss
from harness.store.environment import torchrun_ranks

__all__ = [
    "Processes",
    "SINGLE_PROCESS",
    "processes_from_env",
    "barrier",
    "shutdown",
    "GatheredMetricLoss",
    "average_gradients",
    "wrap_model",
    "check_replicas_agree",
]

#: How long a process waits at a collective for the others (process 0 evaluates the
#: test set meanwhile, which at SOP scale takes minutes).
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=4)


@dataclass(frozen=True)
class Processes:
    """Where this process stands among those that train one run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


#: A run in one process (no ``torchrun``).
SINGLE_PROCESS = Processes()


def processes_from_env(device: torch.device) -> tuple[Processes, torch.device]:
    """The process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), joined
    once (gloo on CPU, NCCL on CUDA), and this process's device (``cuda:LOCAL_RANK``)."""
    procs = Processes(*torchrun_ranks())
    if not procs.distributed:
        return procs, device
    if device.type == "cuda":
        if procs.local_rank >= torch.cuda.device_count():
            raise HarnessError(
                f"process {procs.rank} has LOCAL_RANK {procs.local_rank} but this machine "
                f"has {torch.cuda.device_count()} CUDA device(s)"
            )
        device = torch.device("cuda", procs.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=COLLECTIVE_TIMEOUT,
            **cast(dict[str, Any], {"device_id": device} if device.type == "cuda" else {}),
        )
    return procs, device


def barrier(procs: Processes) -> None:
    if procs.distributed:
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; gradient multiplied by ``factor`` (undoes DDP's 1/N average for
    the embeddings only)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def gather_batch(local: torch.Tensor, procs: Processes) -> torch.Tensor:
    """The shares of all processes concatenated in rank order; only this process's share
    carries a gradient, scaled by the world size.

    Every process then computes the same loss L on the same global batch, so this
    process's share receives exactly dL/d(share) * N, and DDP's average over processes
    gives each backbone parameter the gradient of L summed over all shares: the
    single-process gradient.
    """
    parts = [torch.empty_like(local) for _ in range(procs.world_size)]
    dist.all_gather(parts, local.detach().contiguous())
    parts[procs.rank] = _ScaleGradient.apply(local, float(procs.world_size))
    return torch.cat(parts)


class GatheredMetricLoss(MetricLoss):
    """:class:`~harness.components.losses.MetricLoss` over the global batch: embeddings and labels of
    every process gathered in rank order before mining and the loss.

    Random miners draw as in one process (:meth:`MetricLoss.set_step`: seeded by
    ``(seed, epoch, step, draw)``), so every process mines the tuples a single process
    would on the same global batch, and all compute the same loss.
    """

    def __init__(self, criterion, miner, procs: Processes):
        super().__init__(criterion, miner)
        self.procs = procs

    def _gather(
        self, embeddings: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        all_labels = [torch.empty_like(labels) for _ in range(self.procs.world_size)]
        dist.all_gather(all_labels, labels.contiguous())
        return gather_batch(embeddings.float(), self.procs), torch.cat(all_labels)

    def mine(self, embeddings, labels):
        return self._mine(*self._gather(embeddings, labels))

    def __call__(self, embeddings, labels, *, copy: int = 0, indices=_MINE):
        if indices is not _MINE:  # tuples mined on a gathered batch elsewhere
            raise HarnessError("a method that mines tuples itself cannot train across processes")
        embeddings, labels = self._gather(embeddings, labels)
        mined = self._mine(embeddings, labels)
        return apply_loss(self.instances[copy], embeddings, labels, mined)


def average_gradients(parameters, procs: Processes) -> None:
    """Average the gradients of parameters outside the DDP model (the loss's own: margin
    beta, proxies) over processes: each already holds dL/dtheta of the same global loss,
    averaging keeps them bitwise equal where kernels are not."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not procs.distributed or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= procs.world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def wrap_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``DistributedDataParallel`` around ``model``, as training calls it.

    ``static_graph``: the same parameters take part in every step, and some never do
    (layers after the last stage a head reads), which DDP then learns in the first step
    instead of searching the graph each step. It needs to see the model's output tensors:
    :class:`~harness.methods.base.HeadOutput` is registered as a pytree for that."""
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, static_graph=True
    )


def check_replicas_agree(model: torch.nn.Module, procs: Processes, where: str) -> None:
    """Raise when the processes' copies of ``model`` differ (a collective: every process
    calls it at the same point). Each process sums its parameters in float64; the sums
    are compared across processes. Cheap (one all-gather of one number), and the failure
    it catches is silent otherwise: processes that step with unreduced gradients train
    apart while process 0 alone is evaluated."""
    if not procs.distributed:
        return
    with torch.no_grad():
        local = (
            torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
        )
    if next(model.parameters()).device.type == "cuda":
        local = local.cuda()
    sums = [torch.empty_like(local) for _ in range(procs.world_size)]
    dist.all_gather(sums, local)
    values = [float(v) for v in sums]
    if any(v != values[0] for v in values[1:]):
        raise HarnessError(
            f"the {procs.world_size} processes hold different weights {where} (parameter sums "
            f"{', '.join(f'{v:.12g}' for v in values)}), so they train apart (gradients not reduced, "
            f"or a step that is not the same on every process); run stopped"
        )
