"""SAM's similarity attention and similarity mining (Zheng et al., IJCAI 2022; arXiv
1911.07381), Secs. 3.1-3.2: the weight vector w of each tuple form, the attention map of
Eq. 1 (by autograd, and in closed form on the last map), the soft masks and the
similarity-mining loss L_sm. Where the paper is silent (the normalisation of M, the
reduction of L_sm), :mod:`harness.methods.sam` names the choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "FORMS",
    "TUPLE_SIZE",
    "NORMALIZATIONS",
    "EPS",
    "triplet_weights",
    "pair_weights",
    "quadruplet_weights",
    "tuple_weights",
    "eq1_attention",
    "closed_form_attention",
    "autograd_attention",
    "normalize_attention",
    "soft_mask",
    "similarity_mining_terms",
    "similarity_mining_loss",
]

FORMS = ("triplet", "siamese", "quadruplet")
TUPLE_SIZE = {"siamese": 2, "triplet": 3, "quadruplet": 4}
NORMALIZATIONS = ("max", "minmax")
#: The floor of the norms and maxima divided by (a zero map or embedding stays finite).
EPS = 1e-12


# ------------------------------------------------------------------ Sec. 3.1: weights


def triplet_weights(f_a: torch.Tensor, f_p: torch.Tensor, f_n: torch.Tensor) -> torch.Tensor:
    """Sec. 3.1: w = w^p * w^n, w^p = 1 - |f_a - f_p|, w^n = |f_a - f_n| (element-wise)."""
    return (1 - (f_a - f_p).abs()) * (f_a - f_n).abs()


def pair_weights(f_1: torch.Tensor, f_2: torch.Tensor, same) -> torch.Tensor:
    """Sec. 3.1.1, Siamese: w = 1 - |f_1 - f_2| if the pair is of one class, else |f_1 - f_2|.
    ``same``: a bool or a bool tensor (one per pair)."""
    diff = (f_1 - f_2).abs()
    if isinstance(same, bool):
        return 1 - diff if same else diff
    return torch.where(torch.as_tensor(same, device=diff.device)[..., None], 1 - diff, diff)


def quadruplet_weights(
    f_a: torch.Tensor, f_p: torch.Tensor, f_n1: torch.Tensor, f_n2: torch.Tensor
) -> torch.Tensor:
    """Sec. 3.1.1, quadruplet: w = (1 - |f_a - f_p|) * |f_a - f_n1| * |f_a - f_n2|."""
    return (1 - (f_a - f_p).abs()) * (f_a - f_n1).abs() * (f_a - f_n2).abs()


def tuple_weights(features: torch.Tensor, form: str) -> torch.Tensor:
    """T x k x D embeddings of T tuples (SAM's roles in order: a, p[, n[, n2]]; Siamese pairs
    are positive pairs, the only ones similarity mining uses) -> T x D weight vectors."""
    if form == "siamese":
        return pair_weights(features[:, 0], features[:, 1], True)
    if form == "triplet":
        return triplet_weights(features[:, 0], features[:, 1], features[:, 2])
    if form == "quadruplet":
        return quadruplet_weights(features[:, 0], features[:, 1], features[:, 2], features[:, 3])
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")


# ------------------------------------------------------------------ Sec. 3.1: Eq. 1


def eq1_attention(maps: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Eq. 1: M = ReLU(sum_k alpha_k A_k), alpha_k = GAP(ds/dA_k). ``maps``, ``grads``:
    N x C x h x w -> N x h x w."""
    alpha = grads.mean(dim=(2, 3))
    return F.relu(torch.einsum("nchw,nc->nhw", maps, alpha))


def closed_form_attention(
    maps: torch.Tensor, e: torch.Tensor, f: torch.Tensor, w: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Eq. 1 on the last map under GAP -> Linear (``weight`` D x C) -> L2, without autograd.

    ``maps`` N x C x h x w, ``e`` N x D (before the L2 normalisation), ``f = e / |e|``,
    ``w`` N x D (held constant). ds/de = (w - (w . f) f) / |e| (the Jacobian of the L2
    normalisation), ds/dA_k(x, y) = (W^T ds/de)_k / (h w) at every (x, y), so alpha_k is that
    constant and M = ReLU(A . W^T g) / (h w). Differentiable in all its inputs."""
    g = (w - (w * f).sum(-1, keepdim=True) * f) / e.norm(dim=-1, keepdim=True).clamp_min(EPS)
    alpha = g @ weight / (maps.shape[-2] * maps.shape[-1])
    return F.relu(torch.einsum("nchw,nc->nhw", maps, alpha))


def autograd_attention(
    maps: torch.Tensor, f: torch.Tensor, w: torch.Tensor, *, create_graph: bool
) -> torch.Tensor:
    """Eq. 1 by autograd: ds/dA is the vector-Jacobian product of f (computed from ``maps``)
    with w (w held constant in the derivative; with ``create_graph`` the result stays
    differentiable in the parameters, the maps and w). Rows must not interact (BatchNorm
    frozen or in eval mode, as the protocols run it)."""
    (grads,) = torch.autograd.grad(f, maps, grad_outputs=w, create_graph=create_graph)
    return eq1_attention(maps, grads)


# ------------------------------------------------------------------ Sec. 3.2: masks and L_sm


def normalize_attention(maps: torch.Tensor, how: str = "max") -> torch.Tensor:
    """Each H x W map of N x 1 x H x W on beta's scale: divided by its maximum (``"max"``)
    or min-max rescaled (``"minmax"``); an all-zero map stays 0 (an assumption, see
    :mod:`harness.methods.sam`)."""
    hi = maps.amax(dim=(-2, -1), keepdim=True)
    if how == "max":
        return maps / hi.clamp_min(EPS)
    if how == "minmax":
        lo = maps.amin(dim=(-2, -1), keepdim=True)
        return (maps - lo) / (hi - lo).clamp_min(EPS)
    raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {how!r}")


def soft_mask(maps: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Sec. 3.2: 1 - Sigma(M), Sigma(Z) = sigmoid(alpha (Z - beta)), element-wise: the factor
    that x is multiplied by (near 0 where the attention is high)."""
    return 1 - torch.sigmoid(alpha * (maps - beta))


def _norm(x: torch.Tensor) -> torch.Tensor:
    """Euclidean norm over the last axis, with a finite gradient at 0."""
    return (x.pow(2).sum(-1) + EPS).sqrt()


def similarity_mining_terms(features: torch.Tensor, form: str) -> torch.Tensor:
    """L_sm of each tuple from the masked images' embeddings, T x k x D (roles a, p[, n[,
    n2]]) -> T: Eq. 2 (triplet), -||f*1 - f*2|| (Siamese positive pairs, Sec. 3.2.1), Eq. 2
    on (a, p, n1) plus Eq. 2 on (a, p, n2) (quadruplet, Sec. 3.2.1)."""
    if form == "siamese":
        return -_norm(features[:, 0] - features[:, 1])
    d_ap = _norm(features[:, 0] - features[:, 1])
    if form == "triplet":
        return (d_ap - _norm(features[:, 0] - features[:, 2])).abs()
    if form == "quadruplet":
        return (d_ap - _norm(features[:, 0] - features[:, 2])).abs() + (
            d_ap - _norm(features[:, 0] - features[:, 3])
        ).abs()
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def similarity_mining_loss(
    features: torch.Tensor, form: str, kept: torch.Tensor | None = None
) -> torch.Tensor:
    """L_sm averaged over the tuples (:func:`similarity_mining_terms`), or over those
    ``kept`` (a T mask; 0 where none is) when the tuples fill fixed slots."""
    if kept is None:
        return similarity_mining_terms(features, form).mean()
    # Unkept slots' features zeroed first: whatever their pass gave, no NaN reaches a gradient.
    features = torch.where(kept[:, None, None], features, torch.zeros_like(features))
    terms = similarity_mining_terms(features, form)
    total = torch.where(kept, terms, torch.zeros_like(terms)).sum()
    return total / kept.sum().clamp(min=1).to(terms.dtype)
