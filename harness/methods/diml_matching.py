"""DIML's structural matching (Zhao et al., ICCV 2021, Secs. 3.1-3.2): the similarity of
two G x G grids of local embeddings as an optimal transport between them. The local
similarities and the cost (Eq. 3), the uniform and cross-correlation marginals (Eqs. 7-9),
the plans (Eq. 4, from :func:`harness.components.transport.sinkhorn`), the structural
similarity and distance (Eqs. 5-6) and every pair of a training batch (App. A.3); each
function names its equation. Where the paper and the released code differ (the zero-mass
``delta`` of the marginals), see :mod:`harness.methods.diml`.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from harness.components.transport import sinkhorn

__all__ = [
    "MARGINALS",
    "MARGINAL_NORMS",
    "CC_DELTA",
    "normalized_weights",
    "local_similarity",
    "uniform_marginals",
    "cross_correlation_marginals",
    "transport_plans",
    "structural_similarity",
    "structural_distance",
    "euclidean_from_cosine",
    "pairwise_matching",
]

MARGINALS = ("cross_correlation", "uniform")
#: Mass added to every cross-correlation weight before normalising (the code's constant).
CC_DELTA = 1e-5
#: How relu'd cross-correlations become a marginal: ``"balanced"``, (w + delta) / sum(w +
#: delta), every location some mass and both marginals summing to 1; ``"code"``, w / (sum w
#: + delta), the released evaluation's (wl-zhao/DIML@c15dbea utilities/diml.py lines
#: 32-36), which leaves an image without a positively correlated location no mass.
MARGINAL_NORMS = ("balanced", "code")


def normalized_weights(weights: torch.Tensor, norm: str = "balanced") -> torch.Tensor:
    """Non-negative weights (... x n) normalised over the last dimension by ``norm``
    (:data:`MARGINAL_NORMS`), with ``delta`` = :data:`CC_DELTA`."""
    if norm == "balanced":
        weights = weights + CC_DELTA
        return weights / weights.sum(-1, keepdim=True)
    if norm == "code":
        return weights / (weights.sum(-1, keepdim=True) + CC_DELTA)
    raise ValueError(f"marginal_norm must be one of {MARGINAL_NORMS}, got {norm!r}")


def local_similarity(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cosine similarities S (... x n x m) of L2-normalised local embeddings x (... x n x D)
    and y (... x m x D); the transport cost is ``1 - S`` (Eq. 3 with the cosine distance)."""
    return torch.matmul(x, y.transpose(-1, -2))


def uniform_marginals(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 7: mu_i = 1 / n, nu_j = 1 / m for local embeddings x (... x n x D), y (... x m x D)."""
    mu = x.new_full(x.shape[:-1], 1.0 / x.shape[-2])
    nu = y.new_full(y.shape[:-1], 1.0 / y.shape[-2])
    return mu, nu


def cross_correlation_marginals(
    x: torch.Tensor,
    y: torch.Tensor,
    x_global: torch.Tensor,
    y_global: torch.Tensor,
    *,
    norm: str = "balanced",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. 8-9: each location of one image is weighted by its cosine with the *other*
    image's global embedding, negative values cut to zero, normalised to sum 1.

    ``x``: ... x n x D and ``y``: ... x m x D L2-normalised local embeddings, ``x_global``
    / ``y_global``: ... x D L2-normalised global embeddings. Returns mu (... x n),
    ``mu_i = (relu(<x_i, y_global>) + delta) / sum_i' (...)``, and nu (... x m) likewise
    with the roles swapped. ``delta`` (see :mod:`harness.methods.diml`) keeps every location's
    mass positive and makes both marginals sum exactly to 1; ``norm="code"`` normalises as
    the released code instead (:func:`normalized_weights`).
    """
    alpha_x = torch.matmul(x, y_global[..., :, None]).squeeze(-1)
    alpha_y = torch.matmul(y, x_global[..., :, None]).squeeze(-1)
    return normalized_weights(F.relu(alpha_x), norm), normalized_weights(F.relu(alpha_y), norm)


def _marginals(kind: str, x, y, x_global, y_global):
    if kind == "uniform":
        return uniform_marginals(x, y)
    if kind == "cross_correlation":
        if x_global is None or y_global is None:
            raise ValueError("cross-correlation marginals need the global embeddings")
        return cross_correlation_marginals(x, y, x_global, y_global)
    raise ValueError(f"marginals must be one of {MARGINALS}, got {kind!r}")


def transport_plans(
    x: torch.Tensor,
    y: torch.Tensor,
    x_global: torch.Tensor | None = None,
    y_global: torch.Tensor | None = None,
    *,
    marginals: str = "cross_correlation",
    eps: float = 0.05,
    max_iter: int = 100,
    tol: float = 1e-6,
    plan_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The matching of pairs of grids: ``x``: P x n x D, ``y``: P x m x D (L2-normalised),
    globals P x D. Returns (plan P x n x m, S P x n x m, mu P x n, nu P x m) with the plan
    solving Eq. 4 (entropic, cost 1 - S). ``plan_grad=False`` treats the plan as a
    constant for autograd (the released training code's ``torch.no_grad()``)."""
    s = local_similarity(x, y)
    mu, nu = _marginals(marginals, x, y, x_global, y_global)
    plan = _plans(1 - s, mu, nu, eps=eps, max_iter=max_iter, tol=tol, plan_grad=plan_grad)
    return plan, s, mu, nu


def _plans(
    cost: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    *,
    eps: float,
    max_iter: int,
    tol: float,
    plan_grad: bool,
) -> torch.Tensor:
    """:func:`~harness.components.transport.sinkhorn`'s plans; with ``plan_grad=False`` a
    constant for autograd (the released training code's ``torch.no_grad()``)."""
    if plan_grad:
        return cast(torch.Tensor, sinkhorn(cost, mu, nu, eps=eps, max_iter=max_iter, tol=tol))
    with torch.no_grad():
        return cast(
            torch.Tensor,
            sinkhorn(cost.detach(), mu.detach(), nu.detach(), eps=eps, max_iter=max_iter, tol=tol),
        )


def structural_similarity(plan: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
    """Eq. 5: ``sum_ij T_ij S_ij`` over the last two dimensions."""
    return (plan * similarity).sum((-2, -1))


def euclidean_from_cosine(similarity: torch.Tensor) -> torch.Tensor:
    # ||a - b|| = sqrt(2 - 2 cos) for unit vectors; the clamp keeps sqrt's gradient finite.
    return (2 - 2 * similarity).clamp_min(1e-12).sqrt()


def structural_distance(plan: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
    """Eq. 6 with d = the Euclidean distance of unit vectors (Eq. 16 and the code's margin
    criterion): ``sum_ij T_ij ||z_i - z_j||``."""
    return (plan * euclidean_from_cosine(similarity)).sum((-2, -1))


def pairwise_matching(
    local: torch.Tensor,
    embedding: torch.Tensor,
    *,
    marginals: str = "cross_correlation",
    eps: float = 0.05,
    max_iter: int = 100,
    tol: float = 1e-6,
    plan_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All pairs of a batch (training, App. A.3): ``local`` B x N x D, ``embedding`` B x D.
    Returns (plans B x B x N x N, local similarities S B x B x N x N) with pair (a, b)
    matching a's grid (rows) to b's grid (columns)."""
    bsz, n, d = local.shape
    s = torch.matmul(local.reshape(bsz * n, d), local.reshape(bsz * n, d).t())
    s = s.view(bsz, n, bsz, n).permute(0, 2, 1, 3)  # B x B x N x N
    if marginals == "uniform":
        mu = local.new_full((bsz, bsz, n), 1.0 / n)
        nu = mu
    elif marginals == "cross_correlation":
        # Eqs. 8-9 for every pair: a's cells against b's embedding, b's cells against a's.
        gamma = F.relu(torch.einsum("aid,bd->abi", local, embedding)) + CC_DELTA
        mu = gamma / gamma.sum(-1, keepdim=True)
        nu = mu.transpose(0, 1)
    else:
        raise ValueError(f"marginals must be one of {MARGINALS}, got {marginals!r}")
    cost, mu, nu = (
        (1 - s).reshape(bsz * bsz, n, n),
        mu.reshape(bsz * bsz, n),
        nu.reshape(bsz * bsz, n),
    )
    plan = _plans(cost, mu, nu, eps=eps, max_iter=max_iter, tol=tol, plan_grad=plan_grad)
    return plan.view(bsz, bsz, n, n), s
