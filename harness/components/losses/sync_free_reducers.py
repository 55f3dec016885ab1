"""pytorch-metric-learning's reducers, computed without reading a value from the device.

PML's reducers branch in Python on values of the batch: ``DivisorReducer.sum_and_divide``
(``reducers/divisor_reducer.py`` l. 21-28) tests ``if divisor != 0`` and, in float16,
``if torch.isnan(output)``; ``ThresholdReducer.element_reduction_helper``
(``reducers/threshold_reducer.py`` l. 26-40, the base of ``AvgNonZeroReducer``) selects
``losses[losses > low]`` with a boolean mask and tests ``if len(losses) >= 1``. Each of
these makes the host wait for the device (a scalar read or a shape known only from the
data), on every loss call: the harness's one source of such waits per training step.

The subclasses here take the same decisions with :func:`torch.where` on the device, so
the loss is queued and the host runs on. Their values are PML's: the divisor and the
mean are the same sums divided by the same counts (``tests/components/test_sync_free_reducers.py`` compares
them on random batches, the zero-divisor and the all-zero cases included). Where PML
returns ``zero_loss(embeddings)`` (``sum(embeddings * 0)``), these return the same
zero through :func:`torch.where`, so the graph still reaches the embeddings.

:func:`sync_free_reducer` swaps them into a loss built with PML's defaults.
"""

from __future__ import annotations

from typing import Any

import torch
from pytorch_metric_learning.reducers import (
    AvgNonZeroReducer,
    BaseReducer,
    DivisorReducer,
    MultipleReducers,
    ThresholdReducer,
)

__all__ = [
    "SyncFreeDivisorReducer",
    "SyncFreeThresholdReducer",
    "SyncFreeAvgNonZeroReducer",
    "sync_free_reducer",
    "use_sync_free_reducers",
]


class SyncFreeDivisorReducer(DivisorReducer):
    """``DivisorReducer``: the losses' sum divided by the loss's ``divisor`` (a count the
    loss computed, e.g. the margin loss's active hinge terms), zero when the divisor is.

    PML's float16 rescue (a NaN sum re-summed in float32, l. 24-26) is kept, computed
    always in float16 and chosen by :func:`torch.where` instead of a test."""

    def sum_and_divide(self, losses, embeddings, divisor):
        divisor = torch.as_tensor(divisor, device=losses.device)
        nonzero = divisor != 0
        safe_divisor = torch.where(nonzero, divisor, torch.ones_like(divisor))
        output = torch.sum(losses) / safe_divisor
        if losses.dtype == torch.float16:  # a dtype, known on the host: no sync
            rescued = (torch.sum(losses.float()) / safe_divisor).to(torch.float16)
            output = torch.where(torch.isnan(output), rescued, output)
        return torch.where(nonzero, output, self.zero_loss(embeddings).to(output.dtype))


class SyncFreeThresholdReducer(ThresholdReducer):
    """``ThresholdReducer``: the mean of the losses strictly between ``low`` and ``high``,
    zero when none is, as a masked sum over a count instead of a boolean selection.

    Statistics collection (``collect_stats``, which reads counts with ``.item()``) is
    PML's own and stays off in training, as PML defaults it."""

    def element_reduction_helper(self, losses, embeddings):
        keep = torch.ones_like(losses, dtype=torch.bool)
        if self.low is not None:
            keep = keep & (losses > self.low)
        if self.high is not None:
            keep = keep & (losses < self.high)
        count = keep.sum()
        total = torch.where(keep, losses, torch.zeros_like(losses)).sum()
        mean = total / count.clamp(min=1).to(total.dtype)
        if self.collect_stats:
            self.set_stats(
                losses > self.low if self.low is not None else None,
                losses < self.high if self.high is not None else None,
                int(count),
            )
        return torch.where(count > 0, mean, self.zero_loss(embeddings).to(mean.dtype))


class SyncFreeAvgNonZeroReducer(SyncFreeThresholdReducer, AvgNonZeroReducer):
    """``AvgNonZeroReducer``: the mean of the non-zero losses (``low = 0``)."""

    def __init__(self, **kwargs):
        AvgNonZeroReducer.__init__(self, **kwargs)


#: PML reducer class -> its sync-free counterpart (exact types: a subclass may override
#: the reduction, as :class:`~harness.components.losses.reductions.ActiveTripletReducer` does).
_COUNTERPARTS: dict[type, type] = {
    DivisorReducer: SyncFreeDivisorReducer,
    AvgNonZeroReducer: SyncFreeAvgNonZeroReducer,
}


def sync_free_reducer(reducer: BaseReducer) -> BaseReducer:
    """``reducer``'s sync-free counterpart (its settings kept), or ``reducer`` itself when
    it has none (``MeanReducer`` and the already-reduced losses need none)."""
    if isinstance(reducer, MultipleReducers):
        for name, sub in list(reducer.reducers.items()):
            reducer.reducers[name] = sync_free_reducer(sub)
        reducer.default_reducer = sync_free_reducer(reducer.default_reducer)
        return reducer
    counterpart = _COUNTERPARTS.get(type(reducer))
    if counterpart is None:
        return reducer
    swapped: Any = object.__new__(counterpart)
    swapped.__dict__.update(reducer.__dict__)  # same settings (low/high, collect_stats)
    return swapped


def use_sync_free_reducers(loss: torch.nn.Module) -> torch.nn.Module:
    """``loss`` with its reducer (or each sub-loss's) replaced by the sync-free counterpart."""
    if hasattr(loss, "reducer"):
        loss.reducer = sync_free_reducer(loss.reducer)
    return loss
