"""The run's metric loss as a plugin receives it: the loss instances and the protocol's
miner, its random mining seeded per training step."""

from __future__ import annotations

import numpy as np
import torch

from harness.components.losses.mined import apply_loss

__all__ = ["MetricLoss", "step_seed"]


_MINE = object()


def step_seed(seed: int, epoch: int, step: int, *, draw: int = 0) -> int:
    """The seed of a training step's ``draw``-th random mining: a function of these
    numbers alone, the same on every process."""
    entropy = [seed, epoch, step, 1] + ([draw] if draw else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


class MetricLoss:
    """The run's metric loss as a plugin receives it: the loss (one instance, or one per
    group / level when the head asks for ``metric_loss_copies`` > 1, each with its own
    learnable parameters such as margin betas or proxies) and the protocol's miner.

    ``metric_loss(embeddings, labels)`` mines and applies instance 0; ``copy=p`` picks
    instance p; ``indices=`` applies the loss to tuples mined elsewhere (SAM's masked
    pass reuses the first pass's tuples: ``idx = metric_loss.mine(e, y)``, then
    ``metric_loss(e, y, indices=idx)``); fixed-shape tuples
    (:class:`~harness.components.losses.mined.MinedTriplets`) reach the loss as a mask
    (:func:`~harness.components.losses.mined.apply_loss`). Embeddings are cast to float32 (AMP).
    The instances themselves belong to the trainer (optimised, checkpointed).

    Random miners (distance-weighted sampling) draw from torch's generator seeded by
    :meth:`set_step` with ``(seed, epoch, step, draw)``, ``draw`` counting the mining calls
    of the step (one per group or level): their tuples then depend on nothing else that
    consumes random numbers, so one process and N processes (:mod:`harness.engine.run.distributed`,
    which mines the same gathered batch) draw the same tuples, and a resumed run those of
    an uninterrupted one.
    """

    def __init__(self, loss_module: torch.nn.Module | torch.nn.ModuleList, miner=None):
        #: The loss module's instances: one, or a head's copies (a ``ModuleList``).
        self.instances = (
            list(loss_module) if isinstance(loss_module, torch.nn.ModuleList) else [loss_module]
        )
        self.miner = miner
        self._step: tuple[int, int, int] | None = None
        self._draws = 0

    def set_step(self, seed: int, epoch: int, step: int) -> None:
        """Seed the random mining of training step ``(epoch, step)`` of the run ``seed``."""
        self._step, self._draws = (seed, epoch, step), 0

    def _mine(self, embeddings: torch.Tensor, labels: torch.Tensor):
        if self.miner is None:
            return None
        return self.seeded(self.miner, embeddings, labels)

    def seeded(self, miner, embeddings: torch.Tensor, labels: torch.Tensor):
        """``miner(embeddings, labels)`` under the step's next mining draw (as the protocol's
        miner runs): for a head that mines with a miner of its own."""
        if self._step is None:  # outside a training step (tests, tools): the caller's stream
            return miner(embeddings, labels)
        draw_seed = step_seed(*self._step, draw=self._draws)
        self._draws += 1
        devices = [embeddings.device] if embeddings.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(draw_seed)
            return miner(embeddings, labels)

    @property
    def copies(self) -> int:
        return len(self.instances)

    def module(self, copy: int = 0) -> torch.nn.Module:
        """Loss instance ``copy`` (a PML loss: ``.distance``, learnable parameters)."""
        return self.instances[copy]

    def mine(self, embeddings: torch.Tensor, labels: torch.Tensor):
        """The protocol miner's tuples for this batch, or None (all pairs / no miner)."""
        return self._mine(embeddings.float(), labels)

    def __call__(
        self, embeddings: torch.Tensor, labels: torch.Tensor, *, copy: int = 0, indices=_MINE
    ) -> torch.Tensor:
        embeddings = embeddings.float()
        if indices is _MINE:
            indices = self.mine(embeddings, labels)
        return apply_loss(self.instances[copy], embeddings, labels, indices)
