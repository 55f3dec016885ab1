"""AVSL's similarity graph (Zhang et al., CVPR 2022, Sec. 3): per-dimension similarity
nodes over several backbone levels (Eq. 1), their class activation maps (Eqs. 2, 5), the
edges between the nodes of adjacent levels (Eqs. 3, 7-8), the reliabilities (Eq. 6), the
distance the graph rectifies (Eqs. 8-9) and its attribution to the nodes (Eq. 11); each
function names its equation, and :class:`Graph` applies a head's learned graph to pairs.

Where the paper and the released code (zbr17/AVSL) differ, each choice is an option of
:class:`harness.methods.avsl.AVSLHead`; its module docstring names them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "CAMS",
    "CAM_SHIFTS",
    "LINK_TIES",
    "EDGE_EPS",
    "Graph",
    "similarity_nodes",
    "class_activation_maps",
    "cam_certainty",
    "edge_estimate",
    "normalized_edges",
    "reliability",
    "level_terms",
    "rectified_distance",
    "attribution",
]

CAMS = ("decomposed", "linear")
CAM_SHIFTS = ("map", "width_min")
#: Which of the edges tied at the k-th largest of a row Eq. 7 keeps.
LINK_TIES = ("index", "code")
#: Added to the top-k edge sums before normalising (the code's constant).
EDGE_EPS = 1e-8


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


def level_terms(
    x_levels: torch.Tensor,
    y_levels: torch.Tensor,
    x_cert: torch.Tensor,
    y_cert: torch.Tensor,
    edges: Sequence[torch.Tensor],
    alphas: Sequence[torch.Tensor],
    betas: Sequence[torch.Tensor],
    gain: float,
    rectify: bool,
    detach_nodes: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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
    deltas, probs = level_terms(
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
    deltas, probs = level_terms(
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


@dataclass(frozen=True)
class Graph:
    """A head's learned graph: the normalised edges omega~ of levels 2..L
    (:func:`normalized_edges`, rows the upper level), alpha and beta of levels 2..L, the
    reliability ``gain`` (Eq. 6) and whether the distance is ``rectify``-ed (Eqs. 8-9)."""

    edges: Sequence[torch.Tensor]
    alphas: Sequence[torch.Tensor]
    betas: Sequence[torch.Tensor]
    gain: float
    rectify: bool

    def distance(
        self, x_levels, y_levels, x_cert, y_cert, *, detach_nodes: bool = False
    ) -> torch.Tensor:
        """:func:`rectified_distance` with this graph (broadcasting over leading axes)."""
        return rectified_distance(
            x_levels,
            y_levels,
            x_cert,
            y_cert,
            self.edges,
            self.alphas,
            self.betas,
            gain=self.gain,
            rectify=self.rectify,
            detach_nodes=detach_nodes,
        )

    def attribution(self, x_levels, y_levels, x_cert, y_cert) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`attribution` with this graph: (lambda, contributions), (..., L, r) each."""
        return attribution(
            x_levels,
            y_levels,
            x_cert,
            y_cert,
            self.edges,
            self.alphas,
            self.betas,
            gain=self.gain,
            rectify=self.rectify,
        )
