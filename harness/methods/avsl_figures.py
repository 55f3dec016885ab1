"""AVSL's explanations (Zhang et al., CVPR 2022, Sec. 3.5): Eq. 11's attribution of one
pair as data (:class:`PairAttribution`), the paper's Figs. 6-7 built from it, and the
nodes' class activation maps drawn on the images."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from harness.methods.avsl_graph import Graph, level_terms
from harness.methods.figures import FigureData, Panel

__all__ = [
    "PairAttribution",
    "pair_attribution",
    "rectified_cams",
    "node_weight_maps",
    "level_maps",
    "reliable_nodes_figure",
    "node_expansion_figure",
]


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


def pair_attribution(
    graph: Graph,
    x_levels: torch.Tensor,
    x_cert: torch.Tensor,
    y_levels: torch.Tensor,
    y_cert: torch.Tensor,
) -> PairAttribution:
    """Eq. 11 for one pair (L x r levels and CAM stds each) with what Figs. 6-7 show: per
    level the nodes delta, reliabilities p (levels >= 2), lambda and contributions
    lambda * delta."""
    deltas, probs = level_terms(
        x_levels, y_levels, x_cert, y_cert, graph.edges, graph.alphas, graph.betas, graph.gain, True
    )
    lam, contrib = graph.attribution(x_levels, y_levels, x_cert, y_cert)
    return PairAttribution(
        deltas=torch.stack(deltas),
        reliability=[p.cpu() for p in probs],
        lambdas=lam.cpu(),
        contributions=contrib.cpu(),
        edges=[e.cpu() for e in graph.edges],
        distance=float(contrib.sum()),
    )


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


def rectified_cams(cam: torch.Tensor) -> torch.Tensor:
    """The nodes' CAMs as the explanation maps draw them: each CAM's positive part (where
    the node's evidence is), L1-normalised over the map, B x r x h x w -> B x r x hw
    (float32); a node with no positive value contributes nothing.

    The paper draws node CAMs that "focus on specific parts of images" (Sec. 3.4,
    "Attribution"; Sec. 4.4, Fig. 6) without saying how they are scaled, and the released
    code has no drawing step (zbr17/AVSL@fd2686e: the CAMs of ``avsl_embedder.py`` lines
    105-114 feed the edges and the certainty only). Rectifying is the harness's reading,
    as Grad-CAM's ReLU (Selvaraju et al. 2017, Eq. 2): the min shift of Eq. 5 instead
    gives every location of a CAM the distance to the CAM's minimum, and the max-pool
    spike of the code's CAM (``_linearize``, lines 95-103) makes that offset most of each
    normalised map."""
    return F.normalize(cam.float().flatten(2).clamp_min(0), p=1, dim=-1)


def node_weight_maps(
    cams: Sequence[torch.Tensor], weights: torch.Tensor, size: tuple[int, ...]
) -> torch.Tensor:
    """Per pair, sum over the levels and nodes of ``weights`` (P x L x r) times the node's
    rectified CAM (:func:`rectified_cams`; one P x r x h x w map per level), each level
    resized to ``size``: P x size."""
    total: torch.Tensor | int = 0
    for level, cam in enumerate(cams):
        u = rectified_cams(cam)  # P x r x hw
        m = torch.einsum("pr,prk->pk", weights[:, level], u).view(-1, 1, *cam.shape[-2:])
        total = total + F.interpolate(m, size=size, mode="bilinear", align_corners=False)[:, 0]
    return cast(torch.Tensor, total)


def level_maps(cams: Sequence[torch.Tensor], size: tuple[int, ...]) -> torch.Tensor:
    """Per level, the mean of the nodes' rectified CAMs (:func:`rectified_cams`) at
    ``size``, each map min-max scaled to [0, 1]: B x L x size."""
    out = []
    for cam in cams:
        u = rectified_cams(cam).mean(1).view(cam.shape[0], 1, *cam.shape[2:])
        out.append(F.interpolate(u, size=size, mode="bilinear", align_corners=False))
    maps = torch.cat(out, 1)
    lo = maps.amin(dim=(-2, -1), keepdim=True)
    hi = maps.amax(dim=(-2, -1), keepdim=True)
    return ((maps - lo) / (hi - lo).clamp_min(1e-12)).clamp(0, 1)
