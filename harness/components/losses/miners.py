"""Miners that PML has not, or runs otherwise than the seeds' code: Roth et al.'s
distance-weighted sampling and GeDML's hard-negative selector; and the fixed-shape form of
each, and of PML's distance-weighted miner, which return :class:`~harness.components.losses.mined.MinedTriplets`.

A fixed-shape miner draws for every anchor of the batch, whatever its rows hold, and marks
the slots it would have skipped as not valid, so its output's shape is the batch size's
alone. Where the indexed miner draws from the rows it keeps with one ``torch.multinomial``
call, the fixed-shape miner makes the same call on all rows: when every anchor is kept
(a class-balanced batch of at least two classes, every protocol's case) the two draw the
same tuples from the same seed, and otherwise the same distribution per kept anchor.
``tests/components/test_fixed_shape_mining.py`` checks both."""

from __future__ import annotations

import math

import torch
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.utils import common_functions as c_f

from harness.components.losses.mined import MinedPairs, MinedTriplets

__all__ = [
    "inverse_sphere_log_weights",
    "FixedShapeMiner",
    "RothDistanceWeightedMiner",
    "IndexedRothDistanceWeightedMiner",
    "FixedDistanceWeightedMiner",
    "hard_triplets",
    "hard_triplet_indices",
    "HardNegativeMiner",
    "IndexedHardNegativeMiner",
    "MultiSimilarityPairMiner",
]


def inverse_sphere_log_weights(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """log q(d)^-1 for distances d of unit vectors in R^dim (Wu et al. 2017, "Sampling
    matters", Sec. 4: q(d) ~ d^(n-2) [1 - d^2/4]^((n-3)/2)), up to a constant."""
    return (2.0 - dim) * torch.log(distances) - ((dim - 3) / 2) * torch.log(
        1.0 - 0.25 * distances**2
    )


class FixedShapeMiner(pml_miners.BaseMiner):
    """A PML miner whose ``mine`` returns :class:`MinedTriplets`: a slot per draw and a mask,
    a shape the batch size fixes."""

    def output_assertion(self, output):
        if not isinstance(output, MinedTriplets | MinedPairs):
            raise TypeError(f"{type(self).__name__}.mine must return MinedTriplets or MinedPairs")


def _rows_or_uniform(weights: torch.Tensor) -> torch.Tensor:
    """``weights`` with each row that weighs nothing made uniform, for ``torch.multinomial``
    (which refuses a zero row); the caller marks that row's draws as not valid."""
    empty = weights.sum(dim=1, keepdim=True) <= 0
    return torch.where(empty, torch.ones_like(weights), weights)


def _other_positives(labels, ref_labels, self_reference: bool) -> torch.Tensor:
    """B x B' mask of each anchor's positives, itself excluded when the batch is its own reference."""
    positive = labels[:, None] == ref_labels[None, :]
    if self_reference:
        positive.fill_diagonal_(False)
    return positive


class IndexedRothDistanceWeightedMiner(pml_miners.BaseMiner):
    """Distance-weighted sampling as Roth et al. 2020's code runs it (the ``distance`` batch
    miner of Revisiting_Deep_Metric_Learning_PyTorch; read here in the copies the DIML and
    DGML seeds ship, ``batchminer/distance.py`` of wl-zhao/DIML and XinyiXuXD/DGML-master,
    identical in what follows), returning PML's index lists (``distance_weighted_roth_indexed``;
    :class:`RothDistanceWeightedMiner` is its fixed-shape form).

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
        positive = _other_positives(labels, ref_labels, ref_emb is embeddings)
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


class RothDistanceWeightedMiner(FixedShapeMiner, IndexedRothDistanceWeightedMiner):
    """Roth et al. 2020's distance-weighted sampling (:class:`IndexedRothDistanceWeightedMiner`)
    in a fixed shape: one slot per anchor of the batch, valid where the anchor has a
    positive and a negative of non-zero weight (the anchors the indexed miner keeps). The
    two ``torch.multinomial`` calls are the indexed miner's on every row, so with every
    anchor kept they draw the same triplets from the same seed."""

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        weights = self.negative_weights(embeddings, labels, ref_emb, ref_labels)
        positive = _other_positives(labels, ref_labels, ref_emb is embeddings)
        usable = (weights.sum(dim=1) > 0) & positive.any(dim=1)
        positives = torch.multinomial(_rows_or_uniform(positive.to(weights.dtype)), 1).squeeze(1)
        negatives = torch.multinomial(_rows_or_uniform(weights), 1).squeeze(1)
        anchors = torch.arange(len(labels), device=labels.device)
        return MinedTriplets(anchors, positives, negatives, usable)


class FixedDistanceWeightedMiner(FixedShapeMiner):
    """PML's ``DistanceWeightedMiner`` (Wu et al. 2017, Sec. 4, with PML's upper cutoff
    ``nonzero_loss_cutoff`` and its count of triplets) in a fixed shape.

    PML (``get_random_triplet_indices``, class by class) gives each anchor as many triplets
    as its class has items in the reference set, k, each with a positive drawn uniformly
    among the anchor's other same-class items and a negative drawn with weight q(d)^-1
    (:func:`inverse_sphere_log_weights`, distances clamped below at ``cutoff``, zero at
    ``nonzero_loss_cutoff`` or beyond and where not finite); an anchor whose negatives all
    weigh zero, or whose class has no other item, gets none. Here every anchor has B' slots
    (the reference set's size, k's bound), the first k of them valid for an anchor PML
    keeps, drawn from the same two distributions. The draws themselves differ from PML's
    (one call for all anchors, not one per class), as does the order of the triplets;
    ``tests/components/test_fixed_shape_mining.py`` compares the distributions over
    seeded draws and the expected loss. The log weights are shifted by each anchor's
    largest (PML: the batch's largest), the same distribution unless PML's underflows.
    """

    def __init__(self, cutoff: float = 0.5, nonzero_loss_cutoff: float = 1.4, **kwargs):
        super().__init__(**kwargs)
        c_f.assert_distance_type(self, LpDistance, p=2, power=1, normalize_embeddings=True)
        self.cutoff = float(cutoff)
        self.nonzero_loss_cutoff = float(nonzero_loss_cutoff)
        self.add_to_recordable_attributes(
            list_of_names=["cutoff", "nonzero_loss_cutoff"], is_stat=False
        )

    def negative_weights(self, embeddings, labels, ref_emb, ref_labels) -> torch.Tensor:
        """B x B' sampling weights of each anchor's negatives, as PML's (unnormalised)."""
        distances = self.distance(embeddings, ref_emb).clamp(min=self.cutoff)
        log_w = inverse_sphere_log_weights(distances, embeddings.size(1))
        negative = (
            (labels[:, None] != ref_labels[None, :])
            & torch.isfinite(log_w)
            & (distances < self.nonzero_loss_cutoff)
        )
        log_w = log_w.masked_fill(~negative, -math.inf)
        shift = log_w.max(dim=1, keepdim=True).values.nan_to_num(0.0, neginf=0.0)
        return torch.exp(log_w - shift)

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        slots = len(ref_labels)
        self_reference = ref_emb is embeddings
        weights = self.negative_weights(embeddings, labels, ref_emb, ref_labels)
        positive = _other_positives(labels, ref_labels, self_reference)
        class_size = (labels[:, None] == ref_labels[None, :]).sum(dim=1)  # PML's k
        usable = (weights.sum(dim=1) > 0) & positive.any(dim=1)
        rows = torch.arange(len(labels), device=labels.device)
        positives = torch.multinomial(
            _rows_or_uniform(positive.to(weights.dtype)), slots, replacement=True
        )
        negatives = torch.multinomial(_rows_or_uniform(weights), slots, replacement=True)
        slot = torch.arange(slots, device=labels.device)
        valid = usable[:, None] & (slot[None, :] < class_size[:, None])
        return MinedTriplets(
            rows[:, None].expand(-1, slots).reshape(-1),
            positives.reshape(-1),
            negatives.reshape(-1),
            valid.reshape(-1),
        )

    def get_default_distance(self):
        return LpDistance(p=2, power=1, normalize_embeddings=True)


def _same_and_other_positives(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B x B masks of same-class pairs (the diagonal included) and of each item's others."""
    same = labels[:, None] == labels[None, :]
    return same, same & ~torch.eye(len(labels), dtype=torch.bool, device=labels.device)


def _clamped_negative_distances(dist, same, cutoff: float) -> torch.Tensor:
    """GeDML's selection weights: distances clamped from below at min(largest positive
    distance, ``cutoff``), same-class entries at the dtype's maximum (never the argmin)."""
    largest_positive = dist.masked_fill(~same, -math.inf).max()  # the diagonal is in ``same``
    floor = torch.clamp(largest_positive, max=cutoff)
    return torch.maximum(dist, floor).masked_fill(same, torch.finfo(dist.dtype).max)


def hard_triplets(
    dist: torch.Tensor, labels: torch.Tensor, *, cutoff: float = 0.5
) -> MinedTriplets:
    """GeDML's ``HardSelector`` (zbr17/GeDML src/gedml/core/selectors/hard_selector.py lines
    26-76) on a B x B distance matrix, in a fixed shape: one slot per anchor, valid where the
    anchor has another item of its class; p drawn uniformly among those (torch's generator),
    n the nearest negative after the distances are clamped from below at min(largest
    positive distance, ``cutoff``), so every negative closer than that cutoff ties and the
    lowest index among them wins (``argmin``). The draws are :func:`hard_triplet_indices`'s
    when every anchor has a positive."""
    dist, same, others = dist.detach(), *_same_and_other_positives(labels)
    weights = _clamped_negative_distances(dist, same, cutoff)
    positives = torch.multinomial(_rows_or_uniform(others.float()), 1, replacement=True).flatten()
    anchors = torch.arange(len(labels), device=labels.device)
    return MinedTriplets(anchors, positives, weights.argmin(1), others.any(1))


def hard_triplet_indices(dist: torch.Tensor, labels: torch.Tensor, *, cutoff: float = 0.5):
    """:func:`hard_triplets` as PML's index lists (``hard_negative_indexed``): one triplet
    (a, p, n) per anchor with a positive; p drawn uniformly among the anchor's other
    same-class items (torch's generator), n the nearest negative after the distances are
    clamped from below at min(largest positive distance, ``cutoff``), so every negative
    closer than that cutoff ties and the lowest index among them wins (``argmin``)."""
    dist, same, others = dist.detach(), *_same_and_other_positives(labels)
    weights = _clamped_negative_distances(dist, same, cutoff)
    anchors = torch.nonzero(others.any(1)).flatten()
    positives = torch.multinomial(others[anchors].float(), 1, replacement=True).flatten()
    negatives = weights[anchors].argmin(1)
    return anchors, positives, negatives


class IndexedHardNegativeMiner(pml_miners.BaseMiner):
    """GeDML's ``HardSelector`` as a PML miner returning index lists
    (:func:`hard_triplet_indices`; ``hard_negative_indexed``)."""

    def __init__(self, cutoff: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.cutoff = float(cutoff)

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        return hard_triplet_indices(self.distance(embeddings, ref_emb), labels, cutoff=self.cutoff)

    def get_default_distance(self):
        return LpDistance(normalize_embeddings=True, p=2, power=1)


class HardNegativeMiner(FixedShapeMiner, IndexedHardNegativeMiner):
    """GeDML's ``HardSelector`` as a fixed-shape PML miner (:func:`hard_triplets` on the
    miner's distance, by default the Euclidean distance of unit embeddings: GeDML's ``euclid``
    metric). AVSL's margin configurations select with it (zbr17/AVSL
    examples/config/links/link_margin.yaml line 8, link_avsl_margin.yaml lines 7-11;
    cutoff 0.5: examples/config/args.csv line 52, ``--hardneg_cutoff``)."""

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        return hard_triplets(self.distance(embeddings, ref_emb), labels, cutoff=self.cutoff)


class MultiSimilarityPairMiner(FixedShapeMiner, pml_miners.MultiSimilarityMiner):
    """PML's ``MultiSimilarityMiner`` (Wang et al. 2019, Sec. 3.3, Eq. 3: a positive pair
    is kept when its similarity is below the anchor's hardest negative's plus ``epsilon``, a
    negative pair when above its hardest positive's minus ``epsilon``; the same with
    distances, the inequalities turned) as two B x B' masks
    (:class:`~harness.components.losses.mined.MinedPairs`) instead of the index lists
    PML's loss turns back into masks. The pairs kept are PML's: the hardest pairs are
    a row's maximum and minimum over a mask where PML sorts the row with sentinels."""

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        mat = self.distance(embeddings, ref_emb)
        same = labels[:, None] == ref_labels[None, :]
        positive = _other_positives(labels, ref_labels, ref_emb is embeddings)
        negative = ~same
        eps = self.epsilon
        if self.distance.is_inverted:  # similarities
            hardest_negative = mat.masked_fill(~negative, -math.inf).amax(dim=1, keepdim=True)
            hardest_positive = mat.masked_fill(~positive, math.inf).amin(dim=1, keepdim=True)
            kept_positive = positive & (mat - eps < hardest_negative)
            kept_negative = negative & (mat + eps > hardest_positive)
        else:
            hardest_negative = mat.masked_fill(~negative, math.inf).amin(dim=1, keepdim=True)
            hardest_positive = mat.masked_fill(~positive, -math.inf).amax(dim=1, keepdim=True)
            kept_positive = positive & (mat + eps > hardest_negative)
            kept_negative = negative & (mat - eps < hardest_positive)
        # PML keeps nothing when the batch has no positive pair or no negative pair at all.
        both = positive.any() & negative.any()
        return MinedPairs(kept_positive & both, kept_negative & both)
