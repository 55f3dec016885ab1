"""AVSL: attributable visual similarity learning (Zhang, Zheng, Zhou, Lu, CVPR 2022; code:
zbr17/AVSL).

AVSL compares two images by a graph of per-dimension "similarity nodes" over several
backbone levels: the nodes of a level are rectified by the most correlated nodes of the
level below, weighted by how reliable (how focused) their class activation maps are, and
the overall distance is the sum of the rectified top-level nodes. This file has the pieces
in the order of the paper's Sec. 3 and one configurable head:

======================================  ===================================================
piece                                   paper
======================================  ===================================================
:meth:`AVSLHead.embed`                  nodes' embeddings e^l = h^l(g^l(z^l)) (Sec. 3.2)
:func:`similarity_nodes`                Eq. 1, delta_i = (e~_i - e~'_i)^2 on unit vectors
:func:`class_activation_maps`           Eq. 2, u_i = sum_j a_ij z_j
:func:`edge_estimate`                   Eq. 3, omega^_ij = <u^_i^l, u^_j^{l-1}> (batch mean)
:meth:`AVSLHead.update_edges`           Eq. 4, momentum update of the edge buffers
:func:`cam_certainty`                   std of a normalised CAM (one factor of Eq. 5)
:func:`reliability`                     Eqs. 5-6, p = sigma(alpha * eta + beta)
:func:`normalized_edges`                Eq. 7 (top-k per node) and the normalised
                                        omega~ of Eq. 8
:func:`rectified_distance`              Eqs. 8-9 and d^ = sum_i delta^_i^L
:func:`attribution`                     Eq. 11: lambda_i^l delta_i^l, summing to d^
:meth:`AVSLHead.loss_terms`             Eq. 10: a metric loss per level plus the final
                                        loss on d^
======================================  ===================================================

Registered: ``avsl`` (paper defaults: levels s8/s16/s32, i.e. ResNet-50 layer2/3/4, top
k = 128 clipped to the embedding size, momentum 0.5, every query ranked against the whole
gallery by d^).

Evaluation. ``embed`` returns the unit top-level embedding (the cosine ranking, logged as
``global_*``), ``levels`` (unit embeddings per level) and ``extras["certainty"]`` (B x L x
r: the std of each node's normalised CAM, Eq. 5's per-image factor); ``rerank_fields``
are those two. With ``rank="exhaustive"`` (default, the paper's "Evaluation" in Sec. 3.4)
the head declares ``exhaustive_pairs`` and the engine scores every (query, gallery) pair
in chunks (:meth:`AVSLHead.score_pairs`); ``rank="rerank"`` re-scores only the top
``rerank_k`` cosine candidates. Scores are similarities: -d^.

Where the paper and the released code differ or are silent (each choice is an option):

* Pooling g^l: GAP + GMP, then a 1x1 conv (= Linear) with bias, as the code (the paper
  says "global pooling"); kaiming-normal (fan_out) weights, zero bias, as the code.
* CAMs (Eq. 2). ``cam="decomposed"`` (default, the code): the conv applied to
  ``z + H W max(z) 1[argmax z]`` per channel (bias included), so that the CAM's spatial mean *is* the
  embedding (GAP + GMP are linear in it); ``cam="linear"`` is Eq. 2 as printed,
  ``sum_j a_ij z_j`` without bias or max term. CAMs carry no gradient (the code's
  ``detach``; the paper trains nothing through them).
* Normalised CAM for Eq. 5: min-shifted, L1-normalised over the map, unbiased std (the
  code). The code subtracts the minimum over the *width only* (avsl_embedder.py line 127,
  ``min(dim=-1)`` before ``flatten(2)``): ``cam_shift="width_min"`` (the ``avsl``
  protocol's value); ``"map"`` (the head's default) subtracts the whole map's minimum,
  the shift that makes the normalised map a distribution over locations.
* Eq. 3: the lower level's CAM is average-pooled to the upper level's size (the paper's
  p = min h x min w), each map L2-normalised, the inner products averaged over the batch
  (the code). Eq. 4: the first update overwrites the buffer (the code; a zero buffer
  would halve the first estimate), later ones use gamma = ``momentum`` (0.5, paper and
  code). Edge buffers are updated in training mode only and travel in the state dict.
* Eq. 7-8: the code applies relu to the edges before the top-k (the paper's
  omega~ in [0, 1] needs non-negative edges) and adds 1e-8 to the denominator;
  followed. Ties at the k-th value: the code keeps every entry within 1e-8 of it
  (utils.py ``topk_mask`` lines 5-8), more than k where entries tie, e.g. relu's zeros
  when a node has fewer than k positive edges: ``link_ties="code"`` (the ``avsl``
  protocol's value); ``"index"`` (the head's default) keeps exactly k, lower index first.
* Eq. 6 reliability p = sigma(g (alpha eta + beta)), alpha = 1, beta = 0 at init (the
  code). The paper has g = 1 (default); the code multiplies by ``prob_gamma = 10``
  (``reliability_gain=10``).
* Eq. 10. The paper leaves L^m and L^f as "a loss"; here both are the run's metric loss.
  The per-level losses are copy l of the run's loss on level l's unit embedding. Their
  distance: the code hands every loss ``metric_mat`` = sum_i delta_i^l, the *squared*
  Euclidean distance (avsl_collector.py lines 227-234, index_p = 2), and the final loss
  d^ itself (line 259). ``distance="squared"`` (the ``avsl`` protocol's value) does so
  for Euclidean-distance losses (the margin loss: hinges on d^2 against beta, as
  GeDML's MarginLoss on the code's matrix); ``"euclidean"`` (the head's default) gives
  them the loss's own Euclidean distance and sqrt(d^) (equal to it when nothing is
  rectified). Similarity losses see 1 - d^/2 either way (an exact affine map of the
  code's squared distances, see below);
  the code adds per-level weights (CUB 0.5/1/0.5, Cars and SOP 1/4/4):
  ``level_weights`` (default all 1, the paper's plain sum). The final loss L^f sees d^
  converted to the loss's own distance: a cosine-like similarity 1 - d^/2 for
  similarity losses (ProxyAnchor on cosine with margin 0.1, alpha 32 equals the code's
  alpha 16, margins 1.8/2.2 on squared distance; the code's SOP script gives the level
  losses a negative margin 2.4, i.e. 0.2 here, the loss's ``neg_margin``, and the final
  loss 2.2, i.e. 0.1: ``final_neg_margin``, examples/samples_avsl.sh line 10), d^ or
  sqrt(d^) for Euclidean ones (``distance`` above). The nodes are detached in d^ there,
  so L^f trains alpha, beta only (theta_2 in Eq. 10; paper and code agree). Proxy losses:
  the proxies of each level's loss copy are the "images" compared with (the code) and
  their CAM std is the batch mean of the level's (the code). The top level's loss copy
  evaluates L^f by default (sharing, e.g., the margin loss's beta with level L);
  ``final_loss="separate"`` gives it a copy of its own, as the code.
* The code's training schedule (5-epoch frozen-trunk warm-up, per-part learning rates,
  StepLR) belongs to a protocol, not to the head. The head's collector rate (alpha, beta,
  and the proxies below) is ``collector_lr`` when set (the code's ``--lr_collector``:
  1.1e-4 on CUB, 0.09918 on Cars, 0.06 on SOP, examples/samples_avsl.sh lines 2, 6, 10;
  the ``avsl`` protocol sets these per dataset), else ``inference_lr_scale`` times the
  head's rate (the code's collector / embedder ratios are 0.2, 608.7 and 100).
  The head's defaults (1.0, ``distance="euclidean"``, ``link_ties="index"``,
  ``cam_shift="map"``) are the harness's reading of the paper; the ``avsl`` protocol
  selects the code's arithmetic.
* The code's optimisation around the losses (``examples/config/links/
  link_avsl_proxyanchor.yaml``, ``link_avsl_margin.yaml``), each an option whose head
  default is the harness's reading: the proxies of ProxyAnchor are collector parameters
  (avsl_collector.py lines 104-110) trained at ``--lr_collector`` with ``--wd`` 1e-4
  (``proxies_in_collector``; ``collector_lr`` the collector's absolute rate, CUB 1.1e-4,
  Cars 0.0992, SOP 0.06, examples/samples_avsl.sh lines 2, 6, 10; the default keeps them
  in the loss group at ``lr_loss`` without weight decay); above 1,000 classes only the
  batch's classes' proxies enter the losses (avsl_collector.py lines 153-163:
  ``batch_proxies``); Margin-AVSL mines with GeDML's HardSelector on each level's and on
  the final matrix (``level_miner="hard"``, :func:`hard_triplets`, cutoff 0.5) and has
  four margin losses, each with its beta (``final_loss="separate"``; the default
  ``"shared"`` evaluates L^f with the top level's copy).
* The released tester builds the whole N x N distance with N x N x r intermediates per
  slice; here gallery chunks are scored with a running top-k (harness.components.evaluation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import CosineSimilarity, LpDistance
from torch import nn
from torch.nn import init

from harness.base.errors import HarnessError
from harness.components.losses import PrecomputedDistance, distance_replaced, hard_triplets
from harness.methods.base import (
    FigureData,
    FigureSet,
    HeadOutput,
    Method,
    Panel,
    PaperInfo,
    register_method,
)

__all__ = [
    "AVSLHead",
    "PAPER",
    "similarity_nodes",
    "class_activation_maps",
    "cam_certainty",
    "edge_estimate",
    "normalized_edges",
    "reliability",
    "rectified_distance",
    "attribution",
    "pair_distance_matrix",
    "PairAttribution",
    "reliable_nodes_figure",
    "node_expansion_figure",
]

PAPER = PaperInfo(
    title="Attributable Visual Similarity Learning",
    authors="Borui Zhang, Wenzhao Zheng, Jie Zhou, Jiwen Lu",
    year=2022,
    venue="CVPR 2022",
    code_url="https://github.com/zbr17/AVSL",
    tables=("1", "2", "3"),
    published_selection=(
        "AVSL: no validation split in the paper; the released code (zbr17/AVSL) stops early on the test set"
    ),
)

CAMS = ("decomposed", "linear")
CAM_SHIFTS = ("map", "width_min")
#: The distance each level's loss and the final loss run on, for Euclidean-distance losses.
DISTANCES = ("euclidean", "squared")
#: Which of the edges tied at the k-th largest of a row Eq. 7 keeps.
LINK_TIES = ("index", "code")
RANKS = ("exhaustive", "rerank")
#: Which tuples each level's loss and the final loss train on: the protocol's miner, or
#: GeDML's HardSelector per level and on d^ (:func:`hard_triplets`).
LEVEL_MINERS = ("protocol", "hard")
#: Whether the final loss L^f is the top level's loss copy (sharing, e.g., its margin beta)
#: or a copy of its own, as the code's fourth loss (``lossfinal`` / ``loss``).
FINAL_LOSSES = ("shared", "separate")
#: Added to the top-k edge sums before normalising (the code's constant).
EDGE_EPS = 1e-8
#: Loss names the head trains with (the final loss needs a pair distance or `proxies`).
SUPPORTED_LOSSES = (
    "margin",
    "multi_similarity",
    "contrastive",
    "triplet",
    "binomial_deviance",
    "circle",
    "lifted_structure",
    "ntxent",
    "proxy_anchor",
    "proxy_nca",
)


# ------------------------------------------------------------------ the graph's pieces


def similarity_nodes(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. 1: delta_i = (x_i - y_i)^2 of unit embeddings, broadcasting (..., r) -> (..., r).
    Their sum is the squared Euclidean distance d^l (Sec. 3.4)."""
    return (x - y).square()


def class_activation_maps(
    fmap: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    mode: str = "decomposed",
) -> torch.Tensor:
    """Eq. 2: u_i = sum_j a_ij z_j for every embedding dimension i (B x C x H x W -> B x r x H x W).

    ``weight``: r x C (the level's projection a_ij), ``bias``: r. ``mode="linear"`` is Eq. 2
    as printed (no bias); ``"decomposed"`` (the code) projects ``z + H W max(z) 1[argmax z]`` with
    the bias, whose spatial mean is the embedding of GAP + GMP pooling."""
    if mode not in CAMS:
        raise ValueError(f"cam must be one of {CAMS}, got {mode!r}")
    if mode == "decomposed":
        b, c, h, w = fmap.shape
        flat = fmap.flatten(2)
        top, idx = flat.max(2, keepdim=True)
        peak = torch.zeros_like(flat).scatter_(2, idx, top * (h * w))  # mean over the map: max z
        fmap = fmap + peak.view(b, c, h, w)
    cams = torch.einsum("bchw,rc->brhw", fmap, weight)
    if mode == "decomposed" and bias is not None:
        cams = cams + bias[None, :, None, None]
    return cams


def cam_certainty(cams: torch.Tensor, *, shift: str = "map") -> torch.Tensor:
    """std(u^_i) of each normalised CAM (Eq. 5's per-image factor), B x r x H x W -> B x r.

    Normalisation: subtract a minimum, divide by the L1 norm, unbiased std over the H W
    locations (zbr17/AVSL src/avsl/models/avsl_embedder.py, ``compute_certainty``, lines
    127-131). ``shift="width_min"`` is the code's line 127, ``item.min(dim=-1)``: each row's
    minimum over the width, so a row keeps its offset from the others; ``"map"`` (the
    harness's reading of Eq. 5) subtracts the whole map's minimum."""
    if shift not in CAM_SHIFTS:
        raise ValueError(f"cam_shift must be one of {', '.join(CAM_SHIFTS)}; got {shift!r}")
    if shift == "width_min":
        u = (cams - cams.amin(-1, keepdim=True)).flatten(2)
    else:
        u = cams.flatten(2)
        u = u - u.amin(-1, keepdim=True)
    u = F.normalize(u, p=1, dim=-1)
    if u.shape[-1] < 2:
        return torch.zeros(u.shape[:2], dtype=u.dtype, device=u.device)
    return u.std(-1)


def edge_estimate(upper: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """Eq. 3 over a batch: omega^_ij = mean_b <u^_i^l, u^_j^{l-1}>, an r_l x r_{l-1} matrix.

    ``upper``: B x r x h x w CAMs of level l, ``lower``: B x r' x h' x w' of level l-1,
    average-pooled to h x w when the sizes differ; each map L2-normalised (the code)."""
    if lower.shape[-2:] != upper.shape[-2:]:
        lower = F.adaptive_avg_pool2d(lower, (upper.shape[-2], upper.shape[-1]))
    hi = F.normalize(upper.flatten(2), dim=-1)
    lo = F.normalize(lower.flatten(2), dim=-1)
    return torch.einsum("bip,bjp->ij", hi, lo) / upper.shape[0]


def normalized_edges(edges: torch.Tensor, k: int, *, ties: str = "index") -> torch.Tensor:
    """Eqs. 7-8: omega~_ij = 1[j in top-k of row i] relu(omega_ij) / sum over that top-k (+1e-8).

    ``edges``: r_l x r_{l-1}, rows the upper level's nodes. Which entries tie-break the
    top-k: ``ties="index"`` keeps exactly k per row, the lower index first among equals;
    ``"code"`` keeps every entry within 1e-8 of the row's k-th largest value, more than k
    when several tie there (zbr17/AVSL src/avsl/misc/utils.py ``topk_mask``, lines 5-8, called
    from src/avsl/collectors/avsl_collector.py line 242; the code's link matrix is the
    transpose of this one and is masked per column)."""
    if ties not in LINK_TIES:
        raise ValueError(f"link_ties must be one of {', '.join(LINK_TIES)}; got {ties!r}")
    w = F.relu(edges)
    k = max(1, min(int(k), w.shape[1]))
    ranked = torch.sort(w, dim=1, descending=True, stable=True)  # ties: lower index first
    if ties == "code":
        mask = (w >= ranked.values[:, k - 1 : k] - EDGE_EPS).to(w.dtype)
    else:
        mask = torch.zeros_like(w).scatter_(1, ranked.indices[:, :k], 1.0)
    w = w * mask
    return w / (w.sum(1, keepdim=True) + EDGE_EPS)


def reliability(
    cert_x: torch.Tensor,
    cert_y: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    *,
    gain: float = 1.0,
) -> torch.Tensor:
    """Eqs. 5-6: p_i = sigma(gain * (alpha_i eta_i + beta_i)), eta_i = std(u^_i(x)) std(u^_i(x')).
    Broadcasts (..., r); ``gain`` is the code's ``prob_gamma`` (10), 1 in the paper."""
    return torch.sigmoid(gain * (alpha * (cert_x * cert_y) + beta))


def _rectify_terms(
    x_levels, y_levels, x_cert, y_cert, edges, alphas, betas, gain, rectify, detach_nodes=False
):
    """Per level: nodes delta^l (..., r) and reliabilities p^l (levels >= 2)."""
    deltas, probs = [], []
    for level in range(x_levels.shape[-2]):
        delta = similarity_nodes(x_levels[..., level, :], y_levels[..., level, :])
        deltas.append(delta.detach() if detach_nodes else delta)
        if level and rectify:
            probs.append(
                reliability(
                    x_cert[..., level, :],
                    y_cert[..., level, :],
                    alphas[level - 1],
                    betas[level - 1],
                    gain=gain,
                )
            )
    return deltas, probs


def rectified_distance(
    x_levels: torch.Tensor,
    y_levels: torch.Tensor,
    x_cert: torch.Tensor,
    y_cert: torch.Tensor,
    edges: Sequence[torch.Tensor],
    alphas: Sequence[torch.Tensor],
    betas: Sequence[torch.Tensor],
    *,
    gain: float = 1.0,
    rectify: bool = True,
    detach_nodes: bool = False,
) -> torch.Tensor:
    """Eqs. 8-9 and the overall distance d^ = sum_i delta^_i^L, broadcasting over leading axes.

    ``x_levels`` / ``y_levels``: (..., L, r) unit embeddings per level (e.g. Q x 1 x L x r
    against 1 x G x L x r for a Q x G matrix); ``x_cert`` / ``y_cert``: (..., L, r) CAM
    stds; ``edges``: L-1 normalised r x r matrices omega~ (:func:`normalized_edges`, rows
    the upper level); ``alphas`` / ``betas``: L-1 vectors (levels 2..L). The recursion
    delta^^l = P^l delta^l + (I - P^l) W~^l delta^^{l-1}, delta^^1 = delta^1. With
    ``rectify=False``, d^ = d^L (the top level's squared distance)."""
    deltas, probs = _rectify_terms(
        x_levels, y_levels, x_cert, y_cert, edges, alphas, betas, gain, rectify, detach_nodes
    )
    if not rectify:
        return deltas[-1].sum(-1)
    hat = deltas[0]
    for level in range(1, len(deltas)):
        p = probs[level - 1]
        hat = p * deltas[level] + (1 - p) * (hat @ edges[level - 1].t())
    return hat.sum(-1)


def attribution(
    x_levels: torch.Tensor,
    y_levels: torch.Tensor,
    x_cert: torch.Tensor,
    y_cert: torch.Tensor,
    edges: Sequence[torch.Tensor],
    alphas: Sequence[torch.Tensor],
    betas: Sequence[torch.Tensor],
    *,
    gain: float = 1.0,
    rectify: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 11: the weights lambda^l (..., L, r) and contributions lambda_i^l delta_i^l (..., L, r).

    lambda^L = 1^T P^L, lambda^l = 1^T (I - P^L) W~^L ... (I - P^{l+1}) W~^{l+1} P^l (P^1 = I);
    the contributions sum to :func:`rectified_distance`."""
    deltas, probs = _rectify_terms(
        x_levels, y_levels, x_cert, y_cert, edges, alphas, betas, gain, rectify
    )
    num = len(deltas)
    lambdas = [torch.zeros_like(d) for d in deltas]
    if not rectify:
        lambdas[-1] = torch.ones_like(deltas[-1])
    else:
        carry = torch.ones_like(deltas[-1])  # coefficient row vector on delta^^l
        for level in range(num - 1, 0, -1):
            p = probs[level - 1]
            lambdas[level] = carry * p
            carry = (carry * (1 - p)) @ edges[level - 1]
        lambdas[0] = carry
    lam = torch.stack(lambdas, -2)
    return lam, lam * torch.stack(deltas, -2)


def pair_distance_matrix(
    head: AVSLHead, x_levels, x_cert, y_levels, y_cert, *, detach_nodes: bool = False
) -> torch.Tensor:
    """d^ of every (x, y) pair: (N x L x r, M x L x r) -> N x M, with the head's parameters."""
    return rectified_distance(
        x_levels[:, None],
        y_levels[None],
        x_cert[:, None],
        y_cert[None],
        head.edge_matrices(),
        list(head.alphas),
        list(head.betas),
        gain=head.reliability_gain,
        rectify=head.rectify,
        detach_nodes=detach_nodes,
    )


@contextmanager
def _batch_class_proxies(loss: Any, labels: torch.Tensor):
    """``loss`` with only the proxies of the batch's classes inside the block (yields the
    labels renumbered 0..k-1 in the order of those classes): the code's collector on more
    than 1,000 classes (zbr17/AVSL src/avsl/collectors/avsl_collector.py lines 153-163),
    whose ProxyAnchor then averages the negative terms over those k proxies (src/avsl/losses/
    proxy_anchor_loss.py line 87). Only those rows of the proxies get a gradient."""
    proxies = getattr(loss, "proxies", None)
    if not isinstance(proxies, nn.Parameter):
        raise HarnessError(
            f"AVSL's batch_proxies needs a proxy loss (proxy_anchor), got {type(loss).__name__}"
        )
    classes, local = torch.unique(labels, return_inverse=True)
    num_classes = loss.num_classes
    del loss._parameters["proxies"]
    try:
        loss.__dict__["proxies"] = proxies[classes]
        loss.num_classes = len(classes)
        yield local
    finally:
        del loss.__dict__["proxies"]
        loss._parameters["proxies"] = proxies
        loss.num_classes = num_classes


# ---------------------------------------------------------------------------- head


def _is_euclidean(distance) -> bool:
    return isinstance(distance, LpDistance) and distance.p == 2 and not distance.is_inverted


@contextmanager
def _neg_margin(loss: Any, margin: float | None):
    """``loss`` with its ``neg_margin`` set to ``margin`` inside the block (None: unchanged)."""
    if margin is None:
        yield loss
        return
    if not hasattr(loss, "neg_margin"):
        raise HarnessError(
            f"AVSL's final_neg_margin needs a loss with a negative margin (proxy_anchor), "
            f"got {type(loss).__name__}"
        )
    old, loss.neg_margin = loss.neg_margin, margin
    try:
        yield loss
    finally:
        loss.neg_margin = old


def _stacked(field) -> torch.Tensor:
    return torch.stack(list(field), 1) if isinstance(field, (list, tuple)) else field


@register_method(
    "avsl",
    description="AVSL: multi-level similarity nodes rectified through CAM-overlap edges, "
    "exhaustive ranking by the learned distance",
)
class AVSLHead(Method):
    """Per level GAP + GMP and a 1x1 conv to r dims; nodes, CAM edges and reliabilities."""

    label = "AVSL"
    figure_tuples = ("pair",)
    paper = PAPER
    rerank_fields = ("levels", "certainty")
    supported_losses = SUPPORTED_LOSSES

    def __init__(
        self,
        *,
        channels,
        embedding_size,
        levels: int = 3,
        topk: int = 128,
        momentum: float = 0.5,
        reliability_gain: float = 1.0,
        rectify: bool = True,
        cam: str = "decomposed",
        cam_shift: str = "map",
        level_weights: Sequence[float] | None = None,
        final_weight: float = 1.0,
        rank: str = "exhaustive",
        rerank_k: int = 100,
        inference_lr_scale: float = 1.0,
        distance: str = "euclidean",
        link_ties: str = "index",
        final_neg_margin: float | None = None,
        collector_lr: float = 0.0,
        proxies_in_collector: bool = False,
        batch_proxies: bool = False,
        level_miner: str = "protocol",
        hard_cutoff: float = 0.5,
        final_loss: str = "shared",
    ):
        super().__init__(channels=channels, embedding_size=embedding_size)
        all_stages = ("s8", "s16", "s32")
        if not 1 <= int(levels) <= 3:
            raise ValueError(f"levels must be 1, 2 or 3, got {levels}")
        for option, value, valid in (
            ("cam", cam, CAMS),
            ("cam_shift", cam_shift, CAM_SHIFTS),
            ("rank", rank, RANKS),
            ("distance", distance, DISTANCES),
            ("link_ties", link_ties, LINK_TIES),
            ("level_miner", level_miner, LEVEL_MINERS),
            ("final_loss", final_loss, FINAL_LOSSES),
        ):
            if value not in valid:
                raise ValueError(f"{option} must be one of {', '.join(valid)}; got {value!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if topk < 1:
            raise ValueError(f"topk must be at least 1, got {topk}")
        if collector_lr < 0:
            raise ValueError(
                f"collector_lr must be >= 0 (0: lr_head x inference_lr_scale), got {collector_lr}"
            )
        if rank == "rerank" and rerank_k < 1:
            raise ValueError(f"rerank_k must be at least 1 with rank='rerank', got {rerank_k}")
        weights = (
            [1.0] * int(levels) if level_weights is None else [float(w) for w in level_weights]
        )
        if len(weights) != int(levels):
            raise ValueError(f"level_weights needs {levels} values, got {len(weights)}")
        self.num_levels = int(levels)
        self.stages = all_stages[3 - self.num_levels :]
        self.topk = min(int(topk), embedding_size)
        self.momentum = float(momentum)
        self.reliability_gain = float(reliability_gain)
        self.rectify = bool(rectify) and self.num_levels > 1
        self.cam, self.cam_shift = cam, cam_shift
        self.level_weights, self.final_weight = weights, float(final_weight)
        self.rank = rank
        self.exhaustive_pairs = rank == "exhaustive"
        self.rerank_k = int(rerank_k) if rank == "rerank" else 0
        self.inference_lr_scale = float(inference_lr_scale)
        self.distance, self.link_ties = distance, link_ties
        self.final_neg_margin = None if final_neg_margin is None else float(final_neg_margin)
        self.collector_lr = float(collector_lr)
        self.proxies_in_collector, self.batch_proxies = (
            bool(proxies_in_collector),
            bool(batch_proxies),
        )
        self.level_miner, self.hard_cutoff, self.final_loss = (
            level_miner,
            float(hard_cutoff),
            final_loss,
        )
        separate = final_loss == "separate" and self.rectify and self.final_weight != 0
        self.metric_loss_copies = self.num_levels + (1 if separate else 0)
        self.project = nn.ModuleList()
        for stage in self.stages:
            conv = nn.Linear(channels[stage], embedding_size)  # a 1x1 conv on pooled features
            init.kaiming_normal_(conv.weight, mode="fan_out")
            init.zeros_(conv.bias)
            self.project.append(conv)
        r = embedding_size
        self.alphas = nn.ParameterList(
            [nn.Parameter(torch.ones(r)) for _ in range(self.num_levels - 1)]
        )
        self.betas = nn.ParameterList(
            [nn.Parameter(torch.zeros(r)) for _ in range(self.num_levels - 1)]
        )
        for level in range(1, self.num_levels):
            self.register_buffer(
                f"edges_{level}", torch.zeros(r, r)
            )  # rows: level l nodes, cols: l-1
        self.edge_updates: torch.Tensor
        self.register_buffer("edge_updates", torch.zeros((), dtype=torch.long))

    # ----------------------------------------------------------------- graph state

    def edge_buffers(self) -> list[torch.Tensor]:
        return [getattr(self, f"edges_{level}") for level in range(1, self.num_levels)]

    def edge_matrices(self) -> list[torch.Tensor]:
        """The normalised top-k edges omega~ (Eqs. 7-8) of levels 2..L."""
        return [normalized_edges(e, self.topk, ties=self.link_ties) for e in self.edge_buffers()]

    @torch.no_grad()
    def update_edges(self, cams: Sequence[torch.Tensor]) -> None:
        """Eq. 4 with the batch estimate of Eq. 3; the first update overwrites (the code).
        Which of the two is chosen on the device (:func:`torch.where`): reading the update
        count would make every training step wait for the device."""
        first = self.edge_updates == 0
        for level, buf in enumerate(self.edge_buffers(), start=1):
            new = edge_estimate(cams[level].float(), cams[level - 1].float())
            buf.copy_(torch.where(first, new, self.momentum * buf + (1 - self.momentum) * new))
        self.edge_updates += 1

    # ---------------------------------------------------------------------- embed

    def embed(self, maps):
        levels, cams, certs = [], [], []
        for fmap, conv in zip(maps, self.project, strict=True):
            pooled = fmap.mean(dim=(2, 3)) + fmap.amax(dim=(2, 3))
            levels.append(F.normalize(conv(pooled), dim=-1))
            with torch.no_grad(), torch.autocast(device_type=fmap.device.type, enabled=False):
                cam = class_activation_maps(
                    fmap.detach().float(), conv.weight.float(), conv.bias.float(), mode=self.cam
                )
                cams.append(cam)
                certs.append(cam_certainty(cam, shift=self.cam_shift))
        if self.training and self.num_levels > 1:
            self.update_edges(cams)
        return HeadOutput(
            embedding=levels[-1],
            levels=levels,
            cams=cams,
            extras={"certainty": torch.stack(certs, 1)},
        )

    # ------------------------------------------------------------------ evaluation

    def score_pairs(
        self, query: Mapping[str, torch.Tensor], gallery: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """-d^ of every (query, gallery) pair: Q x G from Q x L x r and G x L x r fields."""
        q_lev, g_lev = _stacked(query["levels"]).float(), _stacked(gallery["levels"]).float()
        q_cert, g_cert = (
            _stacked(query["certainty"]).float(),
            _stacked(gallery["certainty"]).float(),
        )
        return -pair_distance_matrix(self, q_lev, q_cert, g_lev, g_cert)

    def rerank_similarity(self, query, candidates):
        """-d^ of Q x K pairs (query fields Q x L x r, candidates Q x K x L x r)."""
        q_lev, c_lev = _stacked(query["levels"]).float(), _stacked(candidates["levels"]).float()
        q_cert, c_cert = (
            _stacked(query["certainty"]).float(),
            _stacked(candidates["certainty"]).float(),
        )
        d = rectified_distance(
            q_lev[:, None],
            c_lev,
            q_cert[:, None],
            c_cert,
            self.edge_matrices(),
            list(self.alphas),
            list(self.betas),
            gain=self.reliability_gain,
            rectify=self.rectify,
        )
        return -d

    def attribute_pair(
        self, query: HeadOutput, gallery: HeadOutput
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 11 for one pair (batches of one): lambda (L x r) and contributions (L x r)."""
        record = self.pair_attribution(query, gallery)
        return record.lambdas, record.contributions

    @torch.no_grad()
    def pair_attribution(self, query: HeadOutput, gallery: HeadOutput) -> PairAttribution:
        """Eq. 11 for one pair (batches of one) with what Figs. 6-7 show: per level the
        nodes delta, reliabilities p (levels >= 2), lambda and contributions lambda * delta."""

        def fields(out):
            return _stacked(out.levels)[0].float(), out.extras["certainty"][0].float()

        (xl, xc), (yl, yc) = fields(query), fields(gallery)
        args = (self.edge_matrices(), list(self.alphas), list(self.betas))
        deltas, probs = _rectify_terms(xl, yl, xc, yc, *args, self.reliability_gain, True)
        lam, contrib = attribution(
            xl, yl, xc, yc, *args, gain=self.reliability_gain, rectify=self.rectify
        )
        return PairAttribution(
            deltas=torch.stack(deltas),
            reliability=[p.cpu() for p in probs],
            lambdas=lam.cpu(),
            contributions=contrib.cpu(),
            edges=[e.cpu() for e in args[0]],
            distance=float(contrib.sum()),
        )

    def figures(self, kind, images, outputs):
        """Figs. 6 and 7 for a (query, nearest neighbour) pair (:func:`reliable_nodes_figure`,
        :func:`node_expansion_figure`), and the pair's attribution as data (JSON)."""
        query, gallery = outputs
        if (
            not query.levels
            or not query.cams
            or "certainty" not in query.extras
            or self.num_levels < 2
        ):
            return None
        record = self.pair_attribution(query, gallery)
        cams = (
            [c[0].float().cpu() for c in query.cams],
            [c[0].float().cpu() for c in gallery.cams],
        )
        return FigureSet(
            figures=(
                reliable_nodes_figure(*images, cams, record),
                node_expansion_figure(*images, cams, record),
            ),
            records={"_avsl_attribution": record.to_dict()},
        )

    @torch.no_grad()
    def pair_maps(self, query, gallery, same):
        """Eq. 11 drawn on the images: every node's weight lambda_i^l (P pairs at once) on its
        normalised CAM (the one of Eq. 5: min-shifted, L1-normalised), summed over the nodes
        and the levels (each level's map resized to the finest level's grid).

        A pair of two classes is explained by the nodes' contributions to the distance,
        lambda_i^l delta_i^l (Eq. 11, summing to d^); a same-class pair by lambda_i^l
        relu(e_i e'_i), the node's term of the cosine (for unit vectors d^l = 2 - 2 sum_i
        e_i e'_i): a harness choice, the paper attributes the distance only."""

        def fields(out):
            return _stacked(out.levels).float(), out.extras["certainty"].float()

        (xl, xc), (yl, yc) = fields(query), fields(gallery)
        lam, contributions = attribution(
            xl,
            yl,
            xc,
            yc,
            self.edge_matrices(),
            list(self.alphas),
            list(self.betas),
            gain=self.reliability_gain,
            rectify=self.rectify,
        )
        same = torch.as_tensor(same, device=lam.device)[:, None, None]
        weights = torch.where(same, lam * (xl * yl).clamp_min(0), contributions).clamp_min(
            0
        )  # P x L x r
        size = tuple(query.cams[0].shape[-2:])

        def draw(cams):
            total = 0
            for level, cam in enumerate(cams):
                u = cam.float().flatten(2)
                u = F.normalize(u - u.amin(-1, keepdim=True), p=1, dim=-1)  # P x r x hw
                m = torch.einsum("pr,prk->pk", weights[:, level], u).view(-1, 1, *cam.shape[-2:])
                total = (
                    total + F.interpolate(m, size=size, mode="bilinear", align_corners=False)[:, 0]
                )
            return total

        return draw(query.cams), draw(gallery.cams)

    def explain(self, images, output):
        """Per level (K = L maps), the mean of the nodes' normalised CAMs at image size, in [0, 1]."""
        if not output.cams:
            return None
        size = tuple(images.shape[-2:])
        out = []
        for cam in output.cams:
            u = cam.float().flatten(2)
            u = (
                F.normalize(u - u.amin(-1, keepdim=True), p=1, dim=-1)
                .mean(1)
                .view(cam.shape[0], 1, *cam.shape[2:])
            )
            out.append(F.interpolate(u, size=size, mode="bilinear", align_corners=False))
        maps = torch.cat(out, 1)
        lo = maps.amin(dim=(-2, -1), keepdim=True)
        hi = maps.amax(dim=(-2, -1), keepdim=True)
        return ((maps - lo) / (hi - lo).clamp_min(1e-12)).clamp(0, 1)

    # -------------------------------------------------------------------- training

    @classmethod
    def cross_process_refusal(cls, options):
        return (
            "its CAM edges are momentum buffers updated from each batch: each process would "
            "update them from its share, and DistributedDataParallel would overwrite them with "
            "process 0's; train it in one process"
        )

    def loss_terms(self, output, batch):
        """Eq. 10: sum_l w_l L^m(level l) + w_f L^f(d^) (see the module docstring)."""
        labels = batch.labels
        metric = batch.metric_loss
        terms = {}
        for level, emb in enumerate(output.levels):
            copy = level if metric.copies > 1 else 0
            with (
                self._level_distance(metric.module(copy)) as module,
                self._proxies(module, labels) as targets,
            ):
                if self._mines_hard(module):
                    indices = self._hard_tuples(
                        metric, module.distance(emb.detach().float()), targets, module
                    )
                    loss = metric(emb, targets, copy=copy, indices=indices)
                else:
                    loss = metric(emb, targets, copy=copy)
            terms[f"metric_level{level + 1}"] = self.level_weights[level] * loss
        if self.rectify and self.final_weight:
            terms["final"] = self.final_weight * self._final_loss(output, batch)
        return terms

    def _level_distance(self, loss: nn.Module):
        """A context in which a level's loss runs on its own distance, or, with
        ``distance="squared"`` and a Euclidean loss, on the squared Euclidean distance of the
        unit embeddings, sum_i delta_i^l: the code's ``metric_mat`` (avsl_collector.py lines
        227-234), which its margin loss reads as it is."""
        if self.distance == "squared" and _is_euclidean(getattr(loss, "distance", None)):
            return distance_replaced(loss, LpDistance(p=2, power=2, normalize_embeddings=True))
        return nullcontext(loss)

    def _proxies(self, loss: nn.Module, labels: torch.Tensor):
        """A context yielding the labels the loss sees: with ``batch_proxies`` and a proxy
        loss, only the batch's classes' proxies in ``loss`` (:func:`_batch_class_proxies`);
        a loss without proxies is unchanged (the code's rule concerns ``use_proxy`` only)."""
        if self.batch_proxies and isinstance(getattr(loss, "proxies", None), nn.Parameter):
            return _batch_class_proxies(loss, labels)
        return nullcontext(labels)

    def _mines_hard(self, loss: nn.Module) -> bool:
        """``level_miner="hard"`` mines the tuples of a loss without proxies; a proxy loss
        keeps the protocol's miner (none for ProxyAnchor: the code's DefaultSelector,
        link_avsl_proxyanchor.yaml lines 7-11)."""
        return self.level_miner == "hard" and getattr(loss, "proxies", None) is None

    def _hard_tuples(self, metric, dist: torch.Tensor, labels: torch.Tensor, loss: Any):
        """:func:`hard_triplets` on ``dist`` under the step's mining seed (``level_miner="hard"``)."""
        if getattr(loss, "distance", None) is None or loss.distance.is_inverted:
            raise HarnessError(
                "AVSL's level_miner='hard' mines on a distance: it needs a Euclidean-distance "
                "loss (margin)"
            )
        return metric.seeded(
            lambda d, y: hard_triplets(d, y, cutoff=self.hard_cutoff), dist, labels
        )

    def _final_loss(self, output, batch) -> torch.Tensor:
        metric = batch.metric_loss
        top = metric.copies - 1 if metric.copies > 1 else 0
        loss = metric.module(top)
        distance = getattr(loss, "distance", None)
        if distance is None:
            raise HarnessError(
                f"AVSL's final loss needs a PML loss with a distance, got {type(loss).__name__}"
            )
        with torch.autocast(device_type=output.embedding.device.type, enabled=False):
            levels = _stacked(output.levels).float()
            cert = output.extras["certainty"].float()
            found = [
                getattr(metric.module(min(c, metric.copies - 1)), "proxies", None)
                for c in range(self.num_levels)
            ]
            proxies = [p for p in found if p is not None]
            labels = batch.labels
            if len(proxies) == len(found):  # the code: compare with each level's proxies
                if self.batch_proxies:  # the batch's classes only, renumbered (as the level losses)
                    classes, labels = torch.unique(labels, return_inverse=True)
                    proxies = [p[classes] for p in proxies]
                ref = torch.stack([F.normalize(p.float(), dim=-1) for p in proxies], 1)
                ref_cert = cert.mean(dim=(0, 2))[None, :, None].expand(
                    ref.shape[0], -1, ref.shape[2]
                )
                d = pair_distance_matrix(self, levels, cert, ref, ref_cert, detach_nodes=True)
            else:
                d = pair_distance_matrix(self, levels, cert, levels, cert, detach_nodes=True)
            if distance.is_inverted:
                if not isinstance(distance, CosineSimilarity):
                    raise HarnessError(
                        f"AVSL's final loss needs a cosine or Euclidean loss distance, "
                        f"got {type(distance).__name__}"
                    )
                matrix = 1 - d / 2
            else:
                if not isinstance(distance, LpDistance) or distance.p != 2:
                    raise HarnessError(
                        f"AVSL's final loss needs a cosine or Euclidean loss distance, "
                        f"got {type(distance).__name__}"
                    )
                squared = distance.power == 2 or self.distance == "squared"
                matrix = d if squared else d.clamp_min(1e-12).sqrt() ** distance.power
            emb = output.embedding.float()
            if self._mines_hard(
                loss
            ):  # the code's fourth HardSelector, on d^ (link_avsl_margin.yaml)
                indices = self._hard_tuples(metric, matrix, batch.labels, loss)
            else:
                indices = metric.mine(emb, batch.labels)
            with (
                distance_replaced(
                    loss, PrecomputedDistance(matrix, is_inverted=distance.is_inverted)
                ),
                _neg_margin(loss, self.final_neg_margin),
                self._proxies(loss, batch.labels) as targets,
            ):
                return loss(emb, targets, indices)

    def _collector_lr(self, lr_head: float) -> float:
        """The rate of the code's collector (alpha, beta, and the proxies with
        ``proxies_in_collector``): ``collector_lr``, else ``lr_head x inference_lr_scale``."""
        return self.collector_lr or lr_head * self.inference_lr_scale

    def optimizer_groups(self, lr, weight_decay):
        inference = list(self.alphas.parameters()) + list(self.betas.parameters())
        ids = {id(p) for p in inference}
        groups = [
            {
                "params": [p for p in self.head_parameters() if id(p) not in ids],
                "lr": lr,
                "weight_decay": weight_decay,
                "name": "head",
            }
        ]
        if inference:
            groups.append(
                {
                    "params": inference,
                    "lr": self._collector_lr(lr),
                    "weight_decay": weight_decay,
                    "name": "inference",
                }
            )
        return groups

    def loss_optimizer_groups(self, loss_fn, optimizer):
        """With ``proxies_in_collector``, the loss copies' proxies train as the code's
        collector does (its ``proxy_<i>`` parameters, avsl_collector.py lines 104-110,
        optimised by AdamW_collectors.yaml at ``--lr_collector`` with ``--wd``): at the
        collector's rate with the protocol's ``weight_decay``; the loss's other parameters
        (a margin beta) stay in the loss group."""
        if not self.proxies_in_collector:
            return super().loss_optimizer_groups(loss_fn, optimizer)
        proxies = [
            p
            for name, p in loss_fn.named_parameters()
            if p.requires_grad and name.split(".")[-1] == "proxies"
        ]
        ids = {id(p) for p in proxies}
        rest = [p for p in loss_fn.parameters() if p.requires_grad and id(p) not in ids]
        groups = (
            [
                {
                    "params": rest,
                    "lr": optimizer.lr_loss,
                    "weight_decay": optimizer.loss_weight_decay,
                    "name": "loss",
                }
            ]
            if rest
            else []
        )
        if proxies:
            groups.append(
                {
                    "params": proxies,
                    "lr": self._collector_lr(optimizer.lr_head),
                    "weight_decay": optimizer.weight_decay,
                    "name": "proxies",
                }
            )
        return groups

    def step_host_reads(self) -> str:
        reasons = []
        if self.batch_proxies:
            reasons.append(
                "batch_proxies: the batch's classes (torch.unique) size the proxies the loss sees"
            )
        if self.level_miner == "hard":
            reasons.append(
                "level_miner='hard': the anchors with a positive (torch.nonzero) size the tuples"
            )
        return "; ".join(reasons)

    @classmethod
    def search_space(cls, trial, *, embedding_size) -> dict[str, Any]:
        ks = sorted({min(k, embedding_size) for k in (32, 64, 128, 256)})
        return {
            "topk": trial.suggest_categorical("topk", ks),
            "momentum": trial.suggest_float("momentum", 0.3, 0.9),
            "reliability_gain": trial.suggest_categorical("reliability_gain", [1.0, 10.0]),
        }


# ------------------------------------------------------------- attribution figures


@dataclass
class PairAttribution:
    """Eq. 11 for one (query, gallery) pair. Per level l (0 = lowest): ``deltas`` L x r
    (Eq. 1's nodes), ``reliability`` L-1 vectors p^l of levels 2..L (Eq. 6), ``lambdas``
    and ``contributions`` L x r (lambda^l and lambda^l * delta^l, summing to ``distance``
    d^), ``edges`` the normalised omega~ (r_l x r_{l-1}, rows the upper level)."""

    deltas: torch.Tensor
    reliability: list[torch.Tensor]
    lambdas: torch.Tensor
    contributions: torch.Tensor
    edges: list[torch.Tensor]
    distance: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "distance": self.distance,
            "deltas": self.deltas.cpu().tolist(),
            "reliability": [p.tolist() for p in self.reliability],
            "lambdas": self.lambdas.tolist(),
            "contributions": self.contributions.tolist(),
            "note": "AVSL Eq. 11; levels lowest first; reliability for levels 2..L; "
            "contributions sum to the rectified distance d^ (Eq. 9)",
        }


def reliable_nodes_figure(
    query_image, gallery_image, cams, record: PairAttribution, nodes: int = 4
) -> FigureData:
    """Fig. 6 style: the top level's most reliable nodes (the ``2 * nodes`` highest p^L),
    ranked by their contribution lambda_i delta_i to d^, each with its CAM on the query
    (top row) and the gallery image (bottom row)."""
    top = len(record.lambdas) - 1
    p = record.reliability[-1]
    reliable = torch.argsort(p, descending=True)[: 2 * nodes]
    ranked = reliable[torch.argsort(record.contributions[top, reliable], descending=True)][
        :nodes
    ].tolist()
    titles = [
        f"node {i}: p {float(p[i]):.2f}, "
        + "\u03bb\u03b4"
        + f" {float(record.contributions[top, i]):.3g}"
        for i in ranked
    ]
    panels = (
        (
            Panel(query_image, title="query"),
            *(Panel(query_image, cams[0][top][i], t) for i, t in zip(ranked, titles, strict=True)),
        ),
        (
            Panel(gallery_image, title="gallery"),
            *(Panel(gallery_image, cams[1][top][i]) for i in ranked),
        ),
    )
    return FigureData(
        panels,
        suffix="_fig6",
        title=f"AVSL Fig. 6: most reliable top-level nodes by contribution; d^ = {record.distance:.3f}",
    )


def node_expansion_figure(
    query_image, gallery_image, cams, record: PairAttribution, expand: int = 3
) -> FigureData:
    """Fig. 7 style: the top level's most similar node (smallest delta among the more
    reliable half) and most dissimilar node (largest contribution), and its least reliable
    node expanded into the ``expand`` lower-level nodes it draws on most (largest omega~
    of its row), each with lambda; query CAMs on top, gallery CAMs below."""
    top = len(record.lambdas) - 1
    p = record.reliability[-1]
    half = torch.argsort(p, descending=True)[: max(1, len(p) // 2)]
    similar = int(half[record.deltas[top, half].argmin()])
    dissimilar = int(record.contributions[top].argmax())
    unreliable = int(p.argmin())
    lower = torch.argsort(record.edges[-1][unreliable], descending=True)[:expand].tolist()
    columns = [
        (top, similar, "most similar"),
        (top, dissimilar, "most dissimilar"),
        (top, unreliable, "least reliable"),
    ] + [(top - 1, j, f"-> level {top} node") for j in lower]
    lam = "\u03bb"
    titles = []
    for level, i, what in columns:
        extra = (
            f", p {float(p[i]):.2f}"
            if level == top
            else f", w {float(record.edges[-1][unreliable, i]):.2f}"
        )
        titles.append(
            f"{what}\nL{level + 1} #{i}: {lam} {float(record.lambdas[level, i]):.2f}{extra}"
        )
    panels = (
        tuple(
            Panel(query_image, cams[0][level][i], t)
            for (level, i, _), t in zip(columns, titles, strict=True)
        ),
        tuple(Panel(gallery_image, cams[1][level][i]) for level, i, _ in columns),
    )
    return FigureData(
        panels,
        suffix="_fig7",
        title="AVSL Fig. 7: similar / dissimilar nodes, an unreliable node expanded to the level below",
    )
