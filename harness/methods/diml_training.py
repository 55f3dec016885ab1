"""DIML's training mode (Zhao et al., ICCV 2021, App. A.3): the run's metric loss on the
combined pair matrix of a batch, global and structural (Eqs. 15-19), with the released
code's (wl-zhao/DIML) choice of what the miner sees. The head is
:class:`harness.methods.diml.DIMLHead` (``train_structural=True``)."""

from __future__ import annotations

from typing import Any

import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.distances import CosineSimilarity, LpDistance

from harness.base.errors import HarnessError
from harness.components.losses import MetricLoss, PrecomputedDistance, distance_replaced
from harness.methods.diml_matching import (
    euclidean_from_cosine,
    structural_distance,
    structural_similarity,
)

__all__ = ["STRUCTURAL_LOSSES", "structural_loss", "combined_matrix", "training_tuples"]

#: Harness loss names whose PML loss compares the images of a batch pairwise (Eqs. 15-19
#: apply); proxy losses would need G x G proxies (Eq. 21) and are not supported.
STRUCTURAL_LOSSES = (
    "margin",
    "multi_similarity",
    "contrastive",
    "triplet",
    "binomial_deviance",
    "circle",
    "lifted_structure",
)
_PROXY_LOSSES = tuple(
    getattr(pml_losses, name)
    for name in (
        "ProxyAnchorLoss",
        "ProxyNCALoss",
        "ArcFaceLoss",
        "NormalizedSoftmaxLoss",
        "SoftTripleLoss",
        "LargeMarginSoftmaxLoss",
        "CosFaceLoss",
        "SphereFaceLoss",
        "SubCenterArcFaceLoss",
    )
    if hasattr(pml_losses, name)
)


def structural_loss(metric_loss: MetricLoss) -> pml_losses.BaseMetricLossFunction:
    """The run's PML loss, when it compares the batch's images pairwise."""
    loss = metric_loss.module()
    if isinstance(loss, _PROXY_LOSSES) or getattr(loss, "distance", None) is None:
        raise HarnessError(
            f"DIML's training mode needs a pair- or triplet-based loss "
            f"({', '.join(STRUCTURAL_LOSSES)}), got {type(loss).__name__}"
        )
    return loss


def combined_matrix(
    distance: Any, cos: torch.Tensor, plan: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    """The B x B matrix the loss sees, in the kind of its PML ``distance``: for the cosine
    similarity, ``(s_global + s_struct) / 2`` (Eq. 19); for the Euclidean distance,
    ``(d_global + d_struct) / 2`` (Eq. 16) with d the Euclidean distance of unit vectors,
    raised to the distance's power. ``cos``: the global cosines (B x B); ``plan``, ``s``:
    every pair's transport plan and local similarities."""
    if distance.is_inverted:
        if not isinstance(distance, CosineSimilarity):
            raise HarnessError(
                f"DIML training needs a cosine or Euclidean loss distance, got "
                f"{type(distance).__name__}"
            )
        return (cos + structural_similarity(plan, s)) / 2  # Eq. 19
    if not isinstance(distance, LpDistance) or distance.p != 2:
        raise HarnessError(
            f"DIML training needs a cosine or Euclidean loss distance, got "
            f"{type(distance).__name__}"
        )
    matrix = (euclidean_from_cosine(cos) + structural_distance(plan, s)) / 2  # Eq. 16
    if distance.power != 1:
        matrix = matrix**distance.power
    return matrix


def training_tuples(
    metric_loss: MetricLoss,
    emb: torch.Tensor,
    labels: torch.Tensor,
    matrix: torch.Tensor,
    *,
    inverted: bool,
) -> Any:
    """The miner's tuples for DIML training.

    Multi-similarity's pair mining is part of the loss (Eq. 18: s* keeps the pairs whose
    similarity passes min_p s(k, p) - epsilon or max_n s(k, n) + epsilon), and Eq. 19
    replaces that s by the combined similarity, so the miner sees ``matrix``, as the
    released code does (``criteria/multisimilarity_diml.py`` selects its pairs on the
    combined similarity). A batch sampler (distance-weighted sampling for the margin
    loss) sees the global embeddings, as the code's ``batchminer(pooled_feature)``
    in ``criteria/margin_diml.py`` does.
    """
    miner = metric_loss.miner
    if not isinstance(miner, pml_miners.MultiSimilarityMiner):
        return metric_loss.mine(emb, labels)
    if miner.distance.is_inverted != inverted:
        raise HarnessError(
            "DIML training mines multi-similarity pairs on the loss's combined matrix; the "
            "miner and the loss must both use a similarity (or both a distance)"
        )
    # A copy: PML's MultiSimilarityMiner writes its sort sentinels into the matrix it gets.
    with distance_replaced(
        miner, PrecomputedDistance(matrix.detach().clone(), is_inverted=inverted)
    ):
        return metric_loss.mine(emb, labels)
