"""Losses over the batch's pairs, triplets and quadruplets, where PML has none or computes
another arithmetic than the seeds: binomial deviance, multi-similarity with a choice of
anchors, and the quadruplet loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.reducers import AvgNonZeroReducer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from harness.base.errors import HarnessError
from harness.components.losses.mined import register_pair_masked

__all__ = ["BinomialDevianceLoss", "MultiSimilarityLoss", "QuadrupletLoss"]


class BinomialDevianceLoss(pml_losses.BaseMetricLossFunction):
    """Binomial deviance (Yi et al. 2014), as in A-grouping Table 1 and the DGML code.

    With cosine similarity ``s`` of a pair::

        positive pair: softplus(-alpha * pos_scale * (s - margin))
        negative pair: softplus( alpha * neg_scale * (s - margin))

    averaged over positive pairs plus averaged over negative pairs. Defaults are
    Table 1's: m = 0.5, alpha = 2, beta1 = 25 (negatives), beta0 = 1 (positives).
    The printed formula in Table 1 is garbled; the weights' placement follows the
    released DGML code (``criteria/binomial_deviance.py`` l. 15-16:
    ``cons = -1 * pos + 25 * neg``, ``act = 2 * (sim - 0.5) * cons``).

    ``self_pairs``: whether each item's pair with itself (s = 1, no gradient through the
    normalised embedding) counts among the positives. False by default, the pairs of
    PML's ``get_all_pairs_indices``, so the positive mean is over distinct pairs. The
    code counts them (``pair_mask(False, ...)``, l. 57, keeps the diagonal of its label
    equality mask, l. 28 and 37; ``norm_mask``, l. 19-20, divides by that mask's sum), so
    its positive pairs weigh n_pos / (n_pos + B) of what they weigh by default:
    ``self_pairs=True`` reproduces it (``reduction = "dgml"``, see
    :mod:`harness.components.losses.reductions`). The
    self-pairs need the batch as its own reference set.
    """

    def __init__(
        self,
        *,
        alpha: float = 2.0,
        margin: float = 0.5,
        pos_scale: float = 1.0,
        neg_scale: float = 25.0,
        self_pairs: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.alpha, self.margin = alpha, margin
        self.pos_scale, self.neg_scale = pos_scale, neg_scale
        self.self_pairs = bool(self_pairs)
        self.add_to_recordable_attributes(
            list_of_names=["alpha", "margin", "pos_scale", "neg_scale"], is_stat=False
        )

    def get_default_distance(self):
        return CosineSimilarity()

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        a1, p, a2, n = lmu.convert_to_pairs(indices_tuple, labels, ref_labels)
        if self.self_pairs:
            if ref_emb is not embeddings:
                raise ValueError("self_pairs needs the batch as its own reference set (no ref_emb)")
            own = torch.arange(len(embeddings), device=embeddings.device)
            a1, p = torch.cat([a1, own]), torch.cat([p, own])
        sim = self.distance(embeddings, ref_emb)
        if not self.distance.is_inverted:
            raise HarnessError("binomial deviance needs a similarity (inverted) distance")
        zero = embeddings.sum() * 0  # keeps the graph when a batch has no pairs
        pos = F.softplus(-self.alpha * self.pos_scale * (sim[a1, p] - self.margin))
        neg = F.softplus(self.alpha * self.neg_scale * (sim[a2, n] - self.margin))
        loss = (pos.mean() if pos.numel() else zero) + (neg.mean() if neg.numel() else zero)
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}


class MultiSimilarityLoss(pml_losses.MultiSimilarityLoss):
    """PML's multi-similarity loss (Wang et al. 2019, Eq. 4 over the pairs its miner kept),
    with one more choice: how the anchors' losses become one number.

    ``kept_anchors_only=False`` (the default) is PML's: the mean over every anchor of the
    batch, where an anchor with kept pairs of one kind only contributes that term, and
    one with none contributes 0. ``kept_anchors_only=True`` is Roth et al.'s code as
    wl-zhao/DIML@c15dbea ships it (``criteria/multisimilarity.py`` l. 41-55): an anchor
    without a kept positive or without a kept negative is skipped (l. 43-44), and the
    loss is the mean over the remaining anchors (l. 55), 0 when none remains. The pairs
    kept are the same either way: the code's rule (l. 41-42, margin 0.1) is PML's
    ``MultiSimilarityMiner`` with ``epsilon = 0.1``. Computed without a host sync.
    """

    def __init__(self, *, kept_anchors_only: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.kept_anchors_only = bool(kept_anchors_only)

    def _compute_loss(self, mat, pos_mask, neg_mask):
        out = super()._compute_loss(mat, pos_mask, neg_mask)
        if not self.kept_anchors_only:
            return out
        losses = out["loss"]["losses"].flatten()  # one per anchor (PML keeps a B x 1 shape)
        kept = (pos_mask.sum(dim=1) > 0) & (neg_mask.sum(dim=1) > 0)
        count = kept.sum()
        total = torch.where(kept, losses, torch.zeros_like(losses)).sum()
        mean = total / count.clamp(min=1).to(total.dtype)
        loss = torch.where(count > 0, mean, mat.sum() * 0)  # the zero keeps the graph
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}


register_pair_masked(MultiSimilarityLoss)  # takes MinedPairs as masks, as PML's class


class QuadrupletLoss(pml_losses.BaseMetricLossFunction):
    """Quadruplet loss (Chen et al. 2017, "Beyond triplet loss"), for SAM's quadruplet
    architecture (Table 1: Law et al. 2013's quadruplets (a, p, n1, n2), n1 and n2
    negatives of a; the SAM paper prints no formula). With d the distance::

        triplet term:     relu(d(a, p) - d(a, n1) + margin)
        quadruplet term:  relu(d(a, p) - d(n1, n2) + margin2)

    over the triplets (a, p, n1) (mined, or all of the batch's) and, for each, every n2 of
    a class other than a's and n1's (Chen et al.'s constraint); each term averaged over its
    non-zero entries (as PML's triplet loss), then summed. Chen et al. set the second
    margin to half the first (adaptive margins); fixed here at 0.2 and 0.1, the triplet
    loss's margin and its half (an assumption). Euclidean distance on the unit embeddings.
    """

    def __init__(self, *, margin: float = 0.2, margin2: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.margin, self.margin2 = margin, margin2
        self.add_to_recordable_attributes(list_of_names=["margin", "margin2"], is_stat=False)

    def get_default_reducer(self):
        return AvgNonZeroReducer()

    def _sub_loss_names(self):
        return ["triplet_loss", "quadruplet_loss"]

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        a, p, n = lmu.convert_to_triplets(indices_tuple, labels, ref_labels, t_per_anchor="all")
        if len(a) == 0:
            return self.zero_losses()
        mat = self.distance(embeddings, ref_emb)
        ref_mat = mat if ref_emb is embeddings else self.distance(ref_emb, ref_emb)
        ap = mat[a, p]
        first = F.relu(self.distance.margin(ap, mat[a, n]) + self.margin)
        # n2: every reference item whose class is neither the anchor's nor n1's.
        valid = (ref_labels[None, :] != labels[a][:, None]) & (
            ref_labels[None, :] != ref_labels[n][:, None]
        )
        t, n2 = torch.where(valid)
        second = F.relu(self.distance.margin(ap[t], ref_mat[n[t], n2]) + self.margin2)
        return {
            "triplet_loss": {"losses": first, "indices": (a, p, n), "reduction_type": "triplet"},
            "quadruplet_loss": {"losses": second, "indices": a[t], "reduction_type": "element"},
        }
