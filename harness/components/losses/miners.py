"""Miners that PML has not, or runs otherwise than the seeds' code: Roth et al.'s
distance-weighted sampling and GeDML's hard-negative selector."""

from __future__ import annotations

import math

import torch
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.utils import common_functions as c_f

__all__ = [
    "inverse_sphere_log_weights",
    "RothDistanceWeightedMiner",
    "hard_triplets",
    "HardNegativeMiner",
]


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
