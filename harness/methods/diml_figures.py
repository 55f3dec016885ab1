"""DIML's explanation of a pair (Fig. 5): how the structural similarity of a query and a
gallery image is composed, as data (:class:`PairExplanation`) and as a figure
(:func:`pair_figure`): the marginals as heat maps, the plan, and the part-wise
contributions T_ij S_ij."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from harness.methods.base import HeadOutput
from harness.methods.diml_matching import transport_plans
from harness.methods.figures import FigureData, Link, Panel

__all__ = ["PairExplanation", "explain_pair", "pair_figure"]


@dataclass(frozen=True)
class PairExplanation:
    """How the structural similarity of one (query, gallery) pair is composed (Fig. 5).

    ``query_marginal`` / ``gallery_marginal``: G x G (the cross-correlation heat maps,
    Eqs. 8-9, or uniform); ``plan``: N x N transport plan T (query cells x gallery cells,
    N = G*G, row-major cells); ``similarity``: N x N cosines S; ``contributions``: T * S,
    whose sum is ``structural_similarity`` (Eq. 5); ``global_similarity``: the cosine of
    the two embeddings. ``score`` is the re-ranking score (cosine + structural).
    """

    grid: int
    query_marginal: torch.Tensor
    gallery_marginal: torch.Tensor
    plan: torch.Tensor
    similarity: torch.Tensor
    contributions: torch.Tensor
    structural_similarity: float
    global_similarity: float

    @property
    def score(self) -> float:
        return self.global_similarity + self.structural_similarity

    def top_pairs(
        self, count: int = 2, *, largest: bool = True
    ) -> list[tuple[int, int, float, float, float]]:
        """The ``count`` cell pairs with the largest (or smallest) contribution as
        ``(i, j, G^4 T_ij, S_ij, T_ij S_ij)``; G^4 T is Fig. 5's rescaled flow (1 = uniform)."""
        flat = self.contributions.flatten()
        order = torch.argsort(flat, descending=largest)[:count]
        n = self.plan.shape[1]
        scale = self.grid**4
        return [
            (
                int(idx) // n,
                int(idx) % n,
                float(self.plan.flatten()[idx]) * scale,
                float(self.similarity.flatten()[idx]),
                float(flat[idx]),
            )
            for idx in order
        ]


def _single(
    out: HeadOutput | Mapping[str, torch.Tensor], name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    local = out.local if isinstance(out, HeadOutput) else out["local"]
    emb = out.embedding if isinstance(out, HeadOutput) else out["embedding"]
    if local is None:
        raise ValueError(f"{name} has no local embeddings (is it a DIML head's output?)")
    if local.dim() == 3:
        if local.shape[0] != 1:
            raise ValueError(
                f"{name} holds {local.shape[0]} images; pass one (index the batch first)"
            )
        local, emb = local[0], emb.reshape(-1)
    return local.detach().float(), emb.detach().float().reshape(-1)


@torch.no_grad()
def explain_pair(
    query_out: HeadOutput | Mapping[str, torch.Tensor],
    gallery_out: HeadOutput | Mapping[str, torch.Tensor],
    *,
    marginals: str = "cross_correlation",
    eps: float = 0.05,
    max_iter: int = 100,
    tol: float = 1e-6,
) -> PairExplanation:
    """Decompose the structural similarity of one pair (Fig. 5).

    ``query_out`` / ``gallery_out``: a DIML head's output for one image each (a
    :class:`HeadOutput` or a mapping with ``local`` N x D and ``embedding`` D; a batch of
    one is accepted).
    """
    q_loc, q_emb = _single(query_out, "query_out")
    g_loc, g_emb = _single(gallery_out, "gallery_out")
    grid = math.isqrt(q_loc.shape[0])
    if grid * grid != q_loc.shape[0] or g_loc.shape[0] != q_loc.shape[0]:
        raise ValueError(
            f"expected two square grids of the same size, got {q_loc.shape[0]} and {g_loc.shape[0]} cells"
        )
    plan, s, mu, nu = transport_plans(
        q_loc[None],
        g_loc[None],
        q_emb[None],
        g_emb[None],
        marginals=marginals,
        eps=eps,
        max_iter=max_iter,
        tol=tol,
    )
    plan, s = plan[0], s[0]
    contributions = plan * s
    return PairExplanation(
        grid=grid,
        query_marginal=mu[0].view(grid, grid),
        gallery_marginal=nu[0].view(grid, grid),
        plan=plan,
        similarity=s,
        contributions=contributions,
        structural_similarity=float(contributions.sum()),
        global_similarity=float(q_emb @ g_emb),
    )


def pair_figure(
    query_image, gallery_image, explanation: PairExplanation, *, top: int = 2, bottom: int = 1
) -> FigureData:
    """The paper's Fig. 5 as data (the engine draws it).

    The two images side by side, each with its marginal (cross-correlation heat map) over
    it and the G x G grid; arrows join the grid cells of the ``top`` pairs with the largest
    contribution T_ij S_ij (red) and the ``bottom`` pairs with the smallest (blue), each
    labelled ``G^4 T_ij x S_ij``; the title gives cosine -> structural similarity.
    Images: 3 x H x W in [0, 1].
    """
    g = explanation.grid

    def centre(column: int, cell: int) -> tuple[int, int, float, float]:
        r, c = divmod(cell, g)
        return 0, column, (c + 0.5) / g, (r + 0.5) / g

    pairs = [(p, "red") for p in explanation.top_pairs(top)] + [
        (p, "blue") for p in explanation.top_pairs(bottom, largest=False)
    ]
    links = tuple(
        Link(centre(0, i), centre(1, j), colour, f"{t_hat:.2f} x {s_ij:.2f}")
        for (i, j, t_hat, s_ij, _), colour in pairs
    )
    panels = (
        (
            Panel(query_image, explanation.query_marginal, "query"),
            Panel(gallery_image, explanation.gallery_marginal, "gallery"),
        ),
    )
    return FigureData(
        panels,
        title=f"cosine {explanation.global_similarity:.3f} -> structural "
        f"{explanation.structural_similarity:.3f}",
        grid=g,
        links=links,
    )
