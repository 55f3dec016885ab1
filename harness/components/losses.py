"""Metric losses and miners by name, through pytorch-metric-learning (PML).

PML is reused wherever it has the loss; only the binomial deviance loss (used by
three of the seeds) and the quadruplet loss (SAM's Table 1; PML has none) are written
here, against PML's ``BaseMetricLossFunction`` interface so that miners, reducers and
distances compose with them as usual.
Every entry carries its default hyperparameters as data; a protocol's
``[loss.args.<name>]`` table overrides them, and an unknown argument is an error.

``reduction`` is one more argument of every loss: how its per-pair or per-triplet terms
become one number. ``"pml"`` (the default) is the reduction PML gives the loss: the fair
protocols' choice. ``"dgml"`` is the arithmetic of the A-grouping authors' released code
(XinyiXuXD/DGML-master, ``criteria/``), which the A-grouping protocols select:

======================  ==========================================  =====================================
loss                    ``"dgml"`` (the code)                       ``"pml"`` (the default)
======================  ==========================================  =====================================
``margin``              summed hinge terms / triplets with an       / active hinge terms, a triplet's two
                        active term (``margin.py`` l. 67-75;        counted apart (``DivisorReducer``)
                        :class:`ActiveTripletReducer`)
``contrastive``         each hinge term's mean over all sampled     mean over the non-zero terms
                        pairs, zeros included (``contrastive.py``   (``AvgNonZeroReducer``)
                        l. 35-40; ``MeanReducer``)
``binomial_deviance``   the B self-pairs among the positives        distinct pairs only
                        (``binomial_deviance.py`` l. 15-22, 57;
                        ``self_pairs=True``)
======================  ==========================================  =====================================

DGML-master's ``main.py`` cannot run its contrastive or binomial deviance criteria:
``criteria/__init__.py`` (XinyiXuXD/DGML-master@7834411, l. 7-10) maps those names to
the modules themselves, which ``select`` then calls (l. 18), a ``TypeError``. The
``"dgml"`` reductions of those two losses follow the criteria's files (``contrastive.py``,
``binomial_deviance.py``), what the code would compute had it run them; the margin
loss's (``Margin``, a class) is what the code runs.

``"roth"`` is the arithmetic of Roth et al.'s code as the DIML authors ship it and train
their baselines with (wl-zhao/DIML@c15dbea, ``criteria/``), which the ``diml-table1``
grid selects:

======================  ==========================================  =====================================
loss                    ``"roth"`` (the code)                       ``"pml"`` (the default)
======================  ==========================================  =====================================
``margin``              summed hinge terms / triplets with an       / active hinge terms, a triplet's two
                        active term (``margin.py`` l. 59-67;        counted apart (``DivisorReducer``)
                        :class:`ActiveTripletReducer`)
``contrastive``         each hinge term's mean over all sampled     mean over the non-zero terms
                        triplets, zeros included (``contrastive.py`` (``AvgNonZeroReducer``)
                        l. 34-37; ``MeanReducer``)
``multi_similarity``    mean over the anchors that kept at least    mean over every anchor of the
                        one positive and one negative pair, the     batch, an anchor with mined pairs
                        others skipped (``multisimilarity.py``      of one kind counted with that
                        l. 41-55; ``kept_anchors_only=True``)       term alone (``MeanReducer``)
======================  ==========================================  =====================================

The margin and contrastive arithmetic is DGML's too (DGML's criteria derive from the
same code); the names say whose code a protocol follows. Each entry's ``reductions``
holds the same as data (:class:`Reduction`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.distances import BaseDistance, CosineSimilarity, LpDistance
from pytorch_metric_learning.reducers import AvgNonZeroReducer, MeanReducer
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from harness.base.errors import HarnessError, unknown_name
from harness.base.registry import Registry
from harness.components.reducers import SyncFreeDivisorReducer, use_sync_free_reducers

__all__ = [
    "BinomialDevianceLoss",
    "MultiSimilarityLoss",
    "QuadrupletLoss",
    "ProxyAnchorLoss",
    "RothDistanceWeightedMiner",
    "ActiveTripletReducer",
    "LOSSES",
    "MINERS",
    "PML_REDUCTION",
    "Reduction",
    "MetricLoss",
    "create_loss",
    "create_miner",
    "check_loss_args",
    "loss_reductions",
    "step_seed",
    "PrecomputedDistance",
    "distance_replaced",
    "miner_for",
    "loss_defaults",
    "HardNegativeMiner",
    "hard_triplets",
]


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
    ``self_pairs=True`` reproduces it (``reduction = "dgml"``, see :data:`LOSSES`). The
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


class ActiveTripletReducer(SyncFreeDivisorReducer):
    """Each triplet's loss (for PML's ``MarginLoss``: its positive plus its negative hinge
    term), summed and divided by the number of triplets whose loss is non-zero, i.e. with
    at least one active hinge term; zero when none is.

    This is the DGML code's margin loss (``criteria/margin.py`` l. 70-75: ``pair_count =
    sum((pos_loss > 0) + (neg_loss > 0))`` adds boolean tensors, a logical or, so it counts
    triplets). PML's own reducer for the margin loss (``DivisorReducer``) divides by the
    number of active hinge terms, the positive and the negative term of a triplet counted
    apart, which gives 0.5-1x this value. Sub-losses that are not per triplet (the beta
    regulariser) keep ``DivisorReducer``'s arithmetic, computed without a host sync
    (:class:`~harness.components.reducers.SyncFreeDivisorReducer`).
    """

    def triplet_reduction(self, losses, loss_indices, embeddings, labels, divisor=1):
        return self.sum_and_divide(losses, embeddings, torch.sum(losses > 0))


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


class ProxyAnchorLoss(pml_losses.ProxyAnchorLoss):
    """PML's ProxyAnchorLoss (Kim et al. 2020, Eq. 4) with an optional negative margin of its
    own: positive terms alpha (m_p - cos), negative terms alpha (cos + m_n), m_p = ``margin``,
    m_n = ``neg_margin`` (None: ``margin``, PML's loss exactly).

    AVSL's released SOP script (zbr17/AVSL examples/samples_avsl.sh, line 10: ``--pa_pos_margin
    1.8 --pa_neg_margin 2.4 --pa_alpha 16`` on squared distances of unit vectors, d^2 = 2 - 2 cos)
    is m_p = 0.1, m_n = 0.2, alpha = 32 here. PML's terms use one margin m; on the shifted
    similarity cos + s with m = (m_p + m_n) / 2 and s = (m_n - m_p) / 2 they are exactly the
    two-margin terms, so PML's masking, miner weights and reduction are kept unchanged."""

    def __init__(self, num_classes, embedding_size, *, neg_margin: float | None = None, **kwargs):
        super().__init__(num_classes, embedding_size, **kwargs)
        self.neg_margin = None if neg_margin is None else float(neg_margin)
        self._shift = 0.0  # nonzero only inside compute_loss

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        if self.neg_margin is None or self.neg_margin == self.margin:
            return super().compute_loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        if not self.distance.is_inverted:
            raise HarnessError("proxy_anchor's neg_margin needs a similarity (cosine) distance")
        pos_margin = self.margin
        self.margin = (pos_margin + self.neg_margin) / 2
        self._shift = (self.neg_margin - pos_margin) / 2
        try:
            return super().compute_loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        finally:
            self.margin, self._shift = pos_margin, 0.0

    def get_logits(self, embeddings):
        return super().get_logits(embeddings) + self._shift


def inverse_sphere_log_weights(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """log q(d)^-1 for distances d of unit vectors in R^dim (Wu et al. 2017, "Sampling
    matters", Sec. 4: q(d) ~ d^(n-2) [1 - d^2/4]^((n-3)/2)), up to a constant."""
    return (2.0 - dim) * torch.log(distances) - ((dim - 3) / 2) * torch.log(
        1.0 - 0.25 * distances**2
    )


class RothDistanceWeightedMiner(pml_miners.BaseMiner):
    """Distance-weighted sampling as Roth et al. 2020's code runs it (the ``distance``
    batch miner of Revisiting_Deep_Metric_Learning_PyTorch; read here in the copies the
    DIML and DGML seeds ship, ``batchminer/distance.py`` of wl-zhao/DIML and
    XinyiXuXD/DGML-master, identical in what follows).

    Per anchor: distances clamped below at ``cutoff`` (0.5), negatives drawn with weight
    q(d)^-1 (:func:`inverse_sphere_log_weights`, Wu et al. 2017 Sec. 4), one triplet per
    anchor with one positive drawn uniformly among the anchor's other same-class items.
    Two differences from PML's ``DistanceWeightedMiner`` (Wu et al.'s own recipe):

    * no upper cutoff: PML zeroes negatives at distance >= ``nonzero_loss_cutoff`` (1.4);
      the code has that line commented out ("Cutting of values with high distances made
      the results slightly worse");
    * one triplet per anchor, where PML draws as many as the anchor's class has items in
      the batch (``get_random_triplet_indices``: two per anchor at 2 per class).

    Where the code would fail, here: non-finite weights (d = 2 exactly) are dropped, as
    PML drops them (the code's ``np.random.choice`` raises on NaN), and the log weights
    are shifted by each anchor's maximum over its negatives (the code's maximum also
    counts the zeros it writes at same-class entries; after normalisation both give the
    same distribution unless the code's underflows). Draws use torch's generator (seeded
    per epoch by the trainer), not NumPy's.
    """

    def __init__(self, cutoff: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        c_f.assert_distance_type(self, LpDistance, p=2, power=1, normalize_embeddings=True)
        self.cutoff = float(cutoff)
        self.add_to_recordable_attributes(list_of_names=["cutoff"], is_stat=False)

    def negative_weights(self, embeddings, labels, ref_emb, ref_labels) -> torch.Tensor:
        """B x B' sampling probabilities of each anchor's negatives (rows sum to 1, or 0
        for an anchor without a negative)."""
        distances = self.distance(embeddings, ref_emb).clamp(min=self.cutoff)
        log_w = inverse_sphere_log_weights(distances, embeddings.size(1))
        negative = (labels[:, None] != ref_labels[None, :]) & torch.isfinite(log_w)
        log_w = log_w.masked_fill(~negative, -math.inf)
        shift = log_w.max(dim=1, keepdim=True).values.nan_to_num(0.0, neginf=0.0)
        weights = torch.exp(log_w - shift)
        return weights / weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        weights = self.negative_weights(embeddings, labels, ref_emb, ref_labels)
        positive = labels[:, None] == ref_labels[None, :]
        if ref_emb is embeddings:
            positive.fill_diagonal_(False)
        usable = (weights.sum(dim=1) > 0) & positive.any(dim=1)
        anchors = torch.where(usable)[0]
        if len(anchors) == 0:
            empty = torch.tensor([], dtype=torch.long, device=labels.device)
            return empty, empty.clone(), empty.clone()
        positives = torch.multinomial(positive[anchors].to(weights.dtype), 1).squeeze(1)
        negatives = torch.multinomial(weights[anchors], 1).squeeze(1)
        return anchors, positives, negatives

    def get_default_distance(self):
        return LpDistance(p=2, power=1, normalize_embeddings=True)


#: The reduction every loss offers: the one pytorch-metric-learning gives it.
PML_REDUCTION = "pml"


def hard_triplets(dist: torch.Tensor, labels: torch.Tensor, *, cutoff: float = 0.5):
    """GeDML's ``HardSelector`` (zbr17/GeDML src/gedml/core/selectors/hard_selector.py lines
    26-76) on a B x B distance matrix: one triplet (a, p, n) per anchor with a positive;
    p drawn uniformly among the anchor's other same-class items (torch's generator), n the
    nearest negative after the distances are clamped from below at min(largest positive
    distance, ``cutoff``), so every negative closer than that cutoff ties and the lowest
    index among them wins (``argmin``). Returns PML's triplet tuple of index tensors."""
    dist = dist.detach()
    same = labels[:, None] == labels[None, :]
    floor = torch.clamp(dist[same].max(), max=cutoff)
    weights = torch.maximum(dist, floor).masked_fill(same, torch.finfo(dist.dtype).max)
    others = same & ~torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    anchors = torch.nonzero(others.any(1)).flatten()
    positives = torch.multinomial(others[anchors].float(), 1, replacement=True).flatten()
    negatives = weights[anchors].argmin(1)
    return anchors, positives, negatives


class HardNegativeMiner(pml_miners.BaseMiner):
    """GeDML's ``HardSelector`` as a PML miner (:func:`hard_triplets` on the miner's
    distance, by default the Euclidean distance of unit embeddings: GeDML's ``euclid``
    metric). AVSL's margin configurations select with it (zbr17/AVSL
    examples/config/links/link_margin.yaml line 8, link_avsl_margin.yaml lines 7-11;
    cutoff 0.5: examples/config/args.csv line 52, ``--hardneg_cutoff``)."""

    def __init__(self, cutoff: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.cutoff = float(cutoff)

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        return hard_triplets(self.distance(embeddings, ref_emb), labels, cutoff=self.cutoff)

    def get_default_distance(self):
        return LpDistance(normalize_embeddings=True, p=2, power=1)


@dataclass(frozen=True)
class Reduction:
    """A loss's arithmetic as some released code has it, where PML's differs: the code it
    follows, and the constructor arguments that select it, given the loss's resolved
    arguments (it refuses those the followed code has no counterpart for)."""

    follows: str
    arguments: Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class LossEntry:
    cls: type
    defaults: dict[str, Any] = field(default_factory=dict)
    #: Whether the loss holds parameters sized by the classes (proxies, per-class beta).
    needs_classes: bool = False
    description: str = ""
    #: The miner this loss always uses instead of the protocol's (see :func:`miner_for`);
    #: None: the protocol's.
    miner: str | None = None
    #: Reductions besides :data:`PML_REDUCTION`, by the name ``[loss.args.<name>]``'s
    #: ``reduction`` selects them with.
    reductions: dict[str, Reduction] = field(default_factory=dict)


LOSSES: Registry[LossEntry] = Registry("loss")
MINERS: Registry[LossEntry] = Registry("miner")


def _loss(name, cls, description, needs_classes=False, miner=None, reductions=None, **defaults):
    LOSSES.register(name)(
        LossEntry(cls, defaults, needs_classes, description, miner, reductions or {})
    )


def _active_triplet_margin(
    reduction: str, source: str
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The margin loss divided by the triplets with an active term, as ``source`` (a
    criteria/margin.py without a usable beta regulariser, so ``nu`` must be 0)."""

    def loss_kwargs(args: dict[str, Any]) -> dict[str, Any]:
        if args.get("nu", 0):
            raise HarnessError(
                f"loss 'margin': reduction '{reduction}' follows {source}: nu must be 0, got {args['nu']}"
            )
        return {"reducer": ActiveTripletReducer()}

    return loss_kwargs


_dgml_margin = _active_triplet_margin(
    "dgml", "DGML's criteria/margin.py, which has no beta regulariser"
)
_roth_margin = _active_triplet_margin(
    "roth",
    "Roth et al.'s criteria/margin.py, whose beta regulariser cannot run (l. 69 adds an undefined name)",
)


# The A-grouping authors' released code (XinyiXuXD/DGML-master, criteria/). Each group's
# loss is then averaged over the groups (margin.py l. 49, contrastive.py l. 51,
# binomial_deviance.py l. 63), as the A-grouping head does for any reduction.
_DGML_MARGIN = Reduction(
    "criteria/margin.py l. 67-75: the triplets' summed hinge terms divided by the number of triplets "
    "with an active term (PML: by the number of active terms)",
    _dgml_margin,
)
_DGML_CONTRASTIVE = Reduction(
    "criteria/contrastive.py l. 35-40: each hinge term averaged over all sampled pairs, zeros included "
    "(PML: over the non-zero ones)",
    lambda args: {"reducer": MeanReducer()},
)
_DGML_BINOMIAL = Reduction(
    "criteria/binomial_deviance.py l. 15-22, 57: the B self-pairs counted among the positives "
    "(here: excluded)",
    lambda args: {"self_pairs": True},
)

# Roth et al.'s code as the DIML authors ship it (wl-zhao/DIML@c15dbea, criteria/), which
# trains DIML's baselines (DIML App. B.2).
_ROTH_MARGIN = Reduction(
    "criteria/margin.py l. 59-67: the triplets' summed hinge terms divided by the number of triplets "
    "with an active term (PML: by the number of active terms)",
    _roth_margin,
)
_ROTH_CONTRASTIVE = Reduction(
    "criteria/contrastive.py l. 34-37: each hinge term averaged over all sampled triplets, zeros included "
    "(PML: over the non-zero ones)",
    lambda args: {"reducer": MeanReducer()},
)
_ROTH_MULTI_SIMILARITY = Reduction(
    "criteria/multisimilarity.py l. 41-55: the mean over the anchors that kept a positive and a negative "
    "pair (PML: over every anchor)",
    lambda args: {"kept_anchors_only": True},
)

_loss(
    "contrastive",
    pml_losses.ContrastiveLoss,
    "Hadsell et al. 2006; A-grouping Table 1 (m = 1)",
    reductions={"dgml": _DGML_CONTRASTIVE, "roth": _ROTH_CONTRASTIVE},
    pos_margin=0.0,
    neg_margin=1.0,
)
_loss("triplet", pml_losses.TripletMarginLoss, "Schroff et al. 2015", margin=0.2)
_loss(
    "quadruplet",
    QuadrupletLoss,
    "Chen et al. 2017; SAM Table 1 (quadruplet architecture)",
    margin=0.2,
    margin2=0.1,
)
_loss(
    "margin",
    pml_losses.MarginLoss,
    "Wu et al. 2017, learnable per-class beta; A-grouping Table 1 (m = 0.2, eta = 1.2)",
    needs_classes=True,
    reductions={"dgml": _DGML_MARGIN, "roth": _ROTH_MARGIN},
    margin=0.2,
    nu=0.0,
    beta=1.2,
    triplets_per_anchor="all",
    learn_beta=True,
)
_loss(
    "binomial_deviance",
    BinomialDevianceLoss,
    "Yi et al. 2014; A-grouping Table 1",
    reductions={"dgml": _DGML_BINOMIAL},
    alpha=2.0,
    margin=0.5,
    pos_scale=1.0,
    neg_scale=25.0,
)
_loss(
    "multi_similarity",
    MultiSimilarityLoss,
    "Wang et al. 2019",
    miner="multi_similarity",
    reductions={"roth": _ROTH_MULTI_SIMILARITY},
    alpha=2.0,
    beta=50.0,
    base=0.5,
)
_loss(
    "proxy_anchor",
    ProxyAnchorLoss,
    "Kim et al. 2020 (neg_margin: a negative margin of its own)",
    needs_classes=True,
    miner="none",
    margin=0.1,
    alpha=32.0,
)
_loss(
    "proxy_nca",
    pml_losses.ProxyNCALoss,
    "Movshovitz-Attias et al. 2017",
    needs_classes=True,
    miner="none",
    softmax_scale=1.0,
)
_loss(
    "arcface",
    pml_losses.ArcFaceLoss,
    "Deng et al. 2019",
    needs_classes=True,
    miner="none",
    margin=28.6,
    scale=64.0,
)
_loss(
    "normalized_softmax",
    pml_losses.NormalizedSoftmaxLoss,
    "Zhai & Wu 2019",
    needs_classes=True,
    miner="none",
    temperature=0.05,
)
_loss("circle", pml_losses.CircleLoss, "Sun et al. 2020", m=0.4, gamma=80.0)
_loss(
    "lifted_structure",
    pml_losses.LiftedStructureLoss,
    "Oh Song et al. 2016",
    neg_margin=1.0,
    pos_margin=0.0,
)
_loss("ntxent", pml_losses.NTXentLoss, "Chen et al. 2020 (InfoNCE)", temperature=0.07)
_loss(
    "soft_triple",
    pml_losses.SoftTripleLoss,
    "Qian et al. 2019",
    needs_classes=True,
    miner="none",
    centers_per_class=10,
    la=20.0,
    gamma=0.1,
    margin=0.01,
)

MINERS.register("distance_weighted")(
    LossEntry(
        pml_miners.DistanceWeightedMiner,
        {"cutoff": 0.5, "nonzero_loss_cutoff": 1.4},
        description="Wu et al. 2017 (PML: upper cutoff 1.4, a class's size in triplets per anchor)",
    )
)
MINERS.register("distance_weighted_roth")(
    LossEntry(
        RothDistanceWeightedMiner,
        {"cutoff": 0.5},
        description="Roth et al. 2020's code: no upper cutoff, one triplet per anchor",
    )
)
MINERS.register("multi_similarity")(
    LossEntry(pml_miners.MultiSimilarityMiner, {"epsilon": 0.1}, description="Wang et al. 2019")
)
MINERS.register("triplet_margin")(
    LossEntry(
        pml_miners.TripletMarginMiner,
        {"margin": 0.2, "type_of_triplets": "semihard"},
        description="semihard triplets",
    )
)
MINERS.register("hard_negative")(
    LossEntry(
        HardNegativeMiner,
        {"cutoff": 0.5},
        description="GeDML's HardSelector (AVSL's margin configurations)",
    )
)
MINERS.register("batch_hard")(
    LossEntry(pml_miners.BatchHardMiner, {}, description="Hermans et al. 2017")
)
MINERS.register("pair_margin")(
    LossEntry(pml_miners.PairMarginMiner, {"pos_margin": 0.2, "neg_margin": 0.8}, description="")
)


def miner_for(
    loss: str,
    protocol_miner: str,
    protocol_args: dict[str, Any] | None = None,
    *,
    loss_miners: dict[str, dict[str, Any]] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The miner (name, args) a run of ``loss`` uses under a protocol whose miner is
    ``protocol_miner`` and whose per-loss miners (``[loss.miners.<loss>]``) are ``loss_miners``.

    The miner belongs to the loss setting. A protocol fixes one miner for the tuple losses
    (Roth et al. 2020: distance-weighted sampling), and may give one loss another, as the
    setting it transcribes does (A-grouping: DGML's binomial deviance, ``criteria/
    binomial_deviance.py``, takes every pair of the batch, ``REQUIRES_BATCHMINER = False``,
    while its margin and contrastive losses use the distance sampler); that entry wins.
    Otherwise losses over proxies or classes take none: PML would only re-weight their
    samples by the miner's tuples, and Roth et al.'s code (which the DIML seed trains
    with) gives them no batch miner. Multi-similarity brings its own pair mining (Wang
    et al. 2019, Sec. 3.3; PML splits it into ``MultiSimilarityMiner``, epsilon 0.1),
    which Roth et al.'s criterion also runs inside the loss.
    """
    chosen = (loss_miners or {}).get(loss)
    if chosen is not None:
        return chosen["name"], dict(chosen.get("args", {}))
    own = LOSSES.get(loss).miner
    if own is None or own == protocol_miner:
        return protocol_miner, dict(protocol_args or {})
    return own, {}


def loss_defaults(name: str) -> dict[str, Any]:
    return dict(LOSSES.get(name).defaults)


def _known_args(kind: str, name: str, entry: LossEntry, args: dict[str, Any]) -> dict[str, Any]:
    """The entry's defaults updated by ``args``; an argument its class does not take is an error."""
    accepted = set(inspect.signature(vars(entry.cls).get("__init__", entry.cls)).parameters)
    # PML bases take **kwargs (distance, reducer, ...): check against the whole MRO.
    for base in entry.cls.__mro__[1:]:
        if "__init__" in vars(base):
            accepted |= set(inspect.signature(vars(base)["__init__"]).parameters)
    unknown = sorted(set(args) - accepted - {"self", "args", "kwargs"})
    if unknown:
        raise HarnessError(f"unknown argument '{unknown[0]}' for {kind} '{name}'")
    return {**entry.defaults, **args}


def loss_reductions(name: str) -> list[str]:
    """The ``reduction`` values loss ``name`` accepts (:data:`PML_REDUCTION` first)."""
    return [PML_REDUCTION, *LOSSES.get(name).reductions]


def check_loss_args(name: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The constructor arguments of loss ``name`` under a protocol's ``[loss.args.<name>]``
    table ``args``: the entry's defaults, ``args``, and what its ``reduction`` selects
    (default :data:`PML_REDUCTION`: nothing). An unknown argument or reduction is a
    :class:`HarnessError` naming the valid ones."""
    entry = LOSSES.get(name)
    args = dict(args or {})
    reduction = args.pop("reduction", PML_REDUCTION)
    resolved = _known_args("loss", name, entry, args)
    if reduction == PML_REDUCTION:
        return resolved
    if reduction not in entry.reductions:
        raise HarnessError(
            f"loss '{name}': {unknown_name('reduction', str(reduction), loss_reductions(name))}"
        )
    return {**resolved, **entry.reductions[reduction].arguments(resolved)}


def create_loss(
    name: str, args: dict[str, Any] | None = None, *, num_classes: int, embedding_size: int
) -> torch.nn.Module:
    """A PML-style loss: ``loss(embeddings, labels, indices_tuple=None) -> scalar``, its
    reducers PML's arithmetic queued on the device without a host sync
    (:mod:`harness.components.reducers`)."""
    entry = LOSSES.get(name)
    kwargs = check_loss_args(name, args)
    if entry.needs_classes:
        kwargs["num_classes"] = num_classes
        if "embedding_size" in inspect.signature(entry.cls).parameters:
            kwargs["embedding_size"] = embedding_size
    return use_sync_free_reducers(entry.cls(**kwargs))


def create_miner(name: str, args: dict[str, Any] | None = None):
    """A PML miner, or ``None`` for ``"none"``."""
    if name in ("", "none"):
        return None
    entry = MINERS.get(name)
    return entry.cls(**_known_args("miner", name, entry, dict(args or {})))


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
    ``metric_loss(e, y, indices=idx)``). Embeddings are cast to float32 (AMP).
    The instances themselves belong to the trainer (optimised, checkpointed).

    Random miners (distance-weighted sampling) draw from torch's generator seeded by
    :meth:`set_step` with ``(seed, epoch, step, draw)``, ``draw`` counting the mining calls
    of the step (one per group or level): their tuples then depend on nothing else that
    consumes random numbers, so one process and N processes (:mod:`harness.engine.distributed`,
    which mines the same gathered batch) draw the same tuples, and a resumed run those of
    an uninterrupted one.
    """

    def __init__(self, losses: torch.nn.Module | torch.nn.ModuleList, miner=None):
        self.losses = list(losses) if isinstance(losses, torch.nn.ModuleList) else [losses]
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
        return len(self.losses)

    def module(self, copy: int = 0) -> torch.nn.Module:
        """Loss instance ``copy`` (a PML loss: ``.distance``, learnable parameters)."""
        return self.losses[copy]

    def mine(self, embeddings: torch.Tensor, labels: torch.Tensor):
        """The protocol miner's tuples for this batch, or None (all pairs / no miner)."""
        return self._mine(embeddings.float(), labels)

    def __call__(
        self, embeddings: torch.Tensor, labels: torch.Tensor, *, copy: int = 0, indices=_MINE
    ) -> torch.Tensor:
        embeddings = embeddings.float()
        if indices is _MINE:
            indices = self.mine(embeddings, labels)
        return self.losses[copy](embeddings, labels, indices)


class PrecomputedDistance(BaseDistance):
    """A PML distance that returns a given B x B matrix, so that any pair- or triplet-based
    PML loss (and its reducer) runs unchanged on a similarity or distance a method computes
    itself (DIML's combined similarity, AVSL's rectified distance).
    ``is_inverted=True`` for similarities (higher is closer), False for distances."""

    def __init__(self, matrix: torch.Tensor, *, is_inverted: bool):
        super().__init__(normalize_embeddings=False, is_inverted=is_inverted)
        self.matrix = matrix

    def compute_mat(self, query_emb, ref_emb):
        if self.matrix.shape != (len(query_emb), len(query_emb if ref_emb is None else ref_emb)):
            raise ValueError(
                f"precomputed matrix {tuple(self.matrix.shape)} does not match the batch"
            )
        return self.matrix

    def pairwise_distance(
        self, query_emb, ref_emb
    ):  # pragma: no cover - losses here use the matrix
        raise NotImplementedError("PrecomputedDistance only provides the full matrix")


@contextmanager
def distance_replaced(loss: torch.nn.Module, distance: BaseDistance) -> Iterator[torch.nn.Module]:
    """``loss`` (or a miner) computing its matrix with ``distance`` inside the block."""
    old = loss.distance
    loss.distance = distance
    try:
        yield loss
    finally:
        loss.distance = old
