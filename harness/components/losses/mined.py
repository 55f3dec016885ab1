"""Mined tuples in a fixed shape, and the tuple losses that take them as a mask.

PML's miners return index lists whose length depends on the batch's values (the anchors
that have a positive and a negative, the pairs that pass a threshold). Each such list is
a shape the host must read from the device before it can queue the next operation, and
a shape that changes from step to step, so ``torch.compile`` cannot capture the step.

:class:`MinedTriplets` keeps one slot per candidate the miner could draw, a shape fixed
by the batch size alone, with a ``valid`` mask over the slots. The losses here take that
mask instead of a shortened list: a slot that is not valid contributes zero to every sum
and to no count. Their values are PML's on the valid slots (``compact()``), sum for sum
and count for count; ``tests/components/test_fixed_shape_mining.py`` checks each against
PML on random batches, gradients included.

A loss that has no masked form here is applied to ``compact()``, PML's index lists: the
same value, with the one data-dependent shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.reducers import MeanReducer, MultipleReducers

__all__ = ["MinedTriplets", "MinedPairs", "apply_loss", "masked_loss_types"]


@dataclass(frozen=True)
class MinedTriplets:
    """Triplets (anchors[i], positives[i], negatives[i]) in a fixed number of slots, slot i
    counted only where ``valid[i]``. The indices of a slot that is not valid are in range
    (an anchor's own index), so gathering them is safe; their values mean nothing."""

    anchors: torch.Tensor
    positives: torch.Tensor
    negatives: torch.Tensor
    valid: torch.Tensor

    def compact(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """PML's triplet index lists: the valid slots, in slot order (a data-dependent shape)."""
        keep = torch.nonzero(self.valid).flatten()
        return self.anchors[keep], self.positives[keep], self.negatives[keep]

    def __len__(self) -> int:  # the slots, valid or not: a shape, no read of the device
        return len(self.anchors)


@dataclass(frozen=True)
class MinedPairs:
    """Pairs as two B x B' masks over the batch's pairs: the positive and the negative pairs
    kept (the multi-similarity miner's), a shape the batch size fixes."""

    positive: torch.Tensor
    negative: torch.Tensor

    def compact(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """PML's pair index lists (a1, p, a2, n), row by row (a data-dependent shape)."""
        a1, p = torch.nonzero(self.positive, as_tuple=True)
        a2, n = torch.nonzero(self.negative, as_tuple=True)
        return a1, p, a2, n

    def __len__(self) -> int:  # the pairs a mask covers, kept or not
        return self.positive.numel()


def _masked(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.zeros_like(values))


def _sub_reducer(reducer: Any, name: str) -> Any:
    """The reducer PML applies to sub-loss ``name`` (a ``MultipleReducers`` holds one per name)."""
    if isinstance(reducer, MultipleReducers):
        return reducer.reducers[name] if name in reducer.reducers else reducer.default_reducer
    return reducer


def _reduce(loss: Any, loss_dict: dict, embeddings, labels, valid: torch.Tensor) -> torch.Tensor:
    """``loss.reducer`` over per-slot losses already zeroed where not valid.

    PML's counting reducers (``AvgNonZeroReducer``, ``DivisorReducer`` with a divisor that
    counts active terms, :class:`~harness.components.losses.reductions.ActiveTripletReducer`)
    already skip the zeros. ``MeanReducer`` divides by the number of entries, so a per-slot
    sub-loss it reduces is averaged here over the valid slots and handed on as reduced."""
    loss.add_embedding_regularization_to_loss_dict(loss_dict, embeddings)
    for name, sub in loss_dict.items():
        per_slot = sub["reduction_type"] != "already_reduced"
        if per_slot and isinstance(_sub_reducer(loss.reducer, name), MeanReducer):
            values = sub["losses"]
            count = valid.sum()
            mean = values.sum() / count.clamp(min=1).to(values.dtype)
            # PML's zero for an empty list: sum(embeddings * 0), which keeps the graph.
            zero = (embeddings * 0).sum().to(mean.dtype)
            loss_dict[name] = {
                "losses": torch.where(count > 0, mean, zero),
                "indices": None,
                "reduction_type": "already_reduced",
            }
    return loss.reducer(loss_dict, embeddings, labels)


def _margin(loss: pml_losses.MarginLoss, embeddings, labels, t: MinedTriplets) -> torch.Tensor:
    """PML's ``MarginLoss.compute_loss`` (Wu et al. 2017, Eq. 3) on every slot, masked."""
    a, p, n, valid = t.anchors, t.positives, t.negatives, t.valid
    beta = loss.beta if len(loss.beta) == 1 else loss.beta[labels[a]]
    beta = beta.to(device=embeddings.device, dtype=embeddings.dtype)
    mat = loss.distance(embeddings, embeddings)
    pos = _masked(F.relu(loss.distance.margin(mat[a, p], beta) + loss.margin), valid)
    neg = _masked(F.relu(loss.distance.margin(beta, mat[a, n]) + loss.margin), valid)
    divisor = torch.sum(pos > 0) + torch.sum(neg > 0)
    loss_dict = {
        "margin_loss": {
            "losses": pos + neg,
            "indices": (a, p, n),
            "reduction_type": "triplet",
            "divisor": divisor,
        },
        "beta_reg_loss": _beta_regulariser(loss, beta, a, valid, divisor),
    }
    return _reduce(loss, loss_dict, embeddings, labels, valid)


def _beta_regulariser(loss, beta, anchors, valid, divisor) -> dict[str, Any]:
    """PML's ``MarginLoss.compute_reg_loss``: nu * beta per triplet (per class), masked."""
    if not loss.learn_beta:
        return loss.zero_loss()
    if len(loss.beta) == 1:
        return {"losses": beta * loss.nu, "indices": None, "reduction_type": "already_reduced"}
    return {
        "losses": _masked(beta * loss.nu, valid),
        "indices": anchors,
        "reduction_type": "element",
        "divisor": divisor,
    }


def _triplet(
    loss: pml_losses.TripletMarginLoss, embeddings, labels, t: MinedTriplets
) -> torch.Tensor:
    """PML's ``TripletMarginLoss.compute_loss`` (Schroff et al. 2015, Eq. 1) on every slot, masked."""
    a, p, n = t.anchors, t.positives, t.negatives
    mat = loss.distance(embeddings, embeddings)
    ap, an = mat[a, p], mat[a, n]
    if loss.swap:
        an = loss.distance.smallest_dist(an, mat[p, n])
    violation = loss.distance.margin(ap, an) + loss.margin
    values = F.softplus(violation) if loss.smooth_loss else F.relu(violation)
    loss_dict = {
        "loss": {
            "losses": _masked(values, t.valid),
            "indices": (a, p, n),
            "reduction_type": "triplet",
        }
    }
    return _reduce(loss, loss_dict, embeddings, labels, t.valid)


def _contrastive(
    loss: pml_losses.ContrastiveLoss, embeddings, labels, t: MinedTriplets
) -> torch.Tensor:
    """PML's ``ContrastiveLoss`` (Hadsell et al. 2006) on the pairs (a, p) and (a, n) of
    every slot, as PML's ``convert_to_pairs`` makes them from triplets, masked."""
    a, p, n = t.anchors, t.positives, t.negatives
    mat = loss.distance(embeddings, embeddings)
    pos = _masked(loss.get_per_pair_loss(mat[a, p], "pos"), t.valid)
    neg = _masked(loss.get_per_pair_loss(mat[a, n], "neg"), t.valid)
    loss_dict = {
        "pos_loss": {"losses": pos, "indices": (a, p), "reduction_type": "pos_pair"},
        "neg_loss": {"losses": neg, "indices": (a, n), "reduction_type": "neg_pair"},
    }
    return _reduce(loss, loss_dict, embeddings, labels, t.valid)


def _multi_similarity(loss: Any, embeddings, labels, pairs: MinedPairs) -> torch.Tensor:
    """PML's ``MultiSimilarityLoss`` (Wang et al. 2019, Eq. 4) on the pair masks, which its
    ``mat_based_loss`` builds from index lists itself; as PML, zero when at most one
    positive and one negative pair are kept (``GenericPairLoss.compute_loss``)."""
    mat = loss.distance(embeddings, embeddings)
    loss_dict = loss._compute_loss(mat, pairs.positive.to(mat.dtype), pairs.negative.to(mat.dtype))
    loss.add_embedding_regularization_to_loss_dict(loss_dict, embeddings)
    value = loss.reducer(loss_dict, embeddings, labels)  # per anchor: every anchor counts
    few = (pairs.positive.sum() <= 1) & (pairs.negative.sum() <= 1)
    return torch.where(few, (embeddings * 0).sum().to(value.dtype), value)


#: Loss class -> its masked form. Exact types: a subclass may compute otherwise.
_MASKED = {
    pml_losses.MarginLoss: _margin,
    pml_losses.TripletMarginLoss: _triplet,
    pml_losses.ContrastiveLoss: _contrastive,
}
#: Loss class -> its form over pair masks (the harness's multi-similarity subclass keeps
#: PML's arithmetic up to its own reduction, which it applies in ``_compute_loss``).
_PAIR_MASKED = {pml_losses.MultiSimilarityLoss: _multi_similarity}


def register_pair_masked(cls: type) -> None:
    """Let ``cls`` (a subclass of PML's ``MultiSimilarityLoss`` that overrides only
    ``_compute_loss``) take :class:`MinedPairs` as masks."""
    _PAIR_MASKED[cls] = _multi_similarity


def masked_loss_types() -> tuple[type, ...]:
    """The loss classes that take :class:`MinedTriplets` or :class:`MinedPairs` as masks."""
    return (*_MASKED, *_PAIR_MASKED)


def apply_loss(loss: torch.nn.Module, embeddings, labels, indices=None) -> torch.Tensor:
    """``loss(embeddings, labels, indices)``, where ``indices`` may also be
    :class:`MinedTriplets` or :class:`MinedPairs`: the loss's masked form where it has one,
    else PML's on ``compact()``. The batch is its own reference set."""
    if not isinstance(indices, MinedTriplets | MinedPairs):
        return loss(embeddings, labels, indices)
    table: dict[type, Any] = _MASKED if isinstance(indices, MinedTriplets) else _PAIR_MASKED
    masked = table.get(type(loss))
    if masked is None:
        return loss(embeddings, labels, indices.compact())
    cast(Any, loss).reset_stats()  # PML's statistics, as its forward resets them
    return masked(loss, embeddings, labels.to(embeddings.device), indices)
