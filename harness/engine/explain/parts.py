"""The part-mask scores of a set of pair maps (:mod:`harness.engine.explain.explain_run` for a run's
own and baseline maps, :mod:`harness.engine.explain.sanity` for the reference and the
randomised ones): the per-part shares of each map's mass and, for near-miss pairs, the
differing part's share, its area share and the pointing game, on the whole image and
within the object (:mod:`harness.components.explanation.scores`)."""

from __future__ import annotations

import numpy as np
import torch

from harness.components.explanation.scores import (
    part_shares,
    region_scores,
    within_object_scores,
)
from harness.engine.explain.maps import PairMaps, Pairs

__all__ = ["uniform_if_empty", "part_scores"]


def uniform_if_empty(maps: torch.Tensor) -> torch.Tensor:
    """Maps without mass (a Grad-CAM whose ReLU keeps nothing) read as uniform: no pixel is
    preferred, which is also how the deletion order treats them (ties broken at random)."""
    empty = maps.flatten(1).sum(1) <= 0
    return torch.where(empty[:, None, None], torch.ones_like(maps), maps)


def part_scores(
    maps: PairMaps, labels_q: torch.Tensor, labels_g: torch.Tensor, pairs: Pairs, parts: list[str]
) -> dict[str, np.ndarray]:
    """Per pair: object share and per-part shares, and (near-miss pairs) the differing part's
    share, its area share and the pointing game, on the image and within the object
    (``within_object_*``); each the mean over the pair's two images."""
    out: dict[str, np.ndarray] = {}
    maps = PairMaps(uniform_if_empty(maps.query), uniform_if_empty(maps.gallery))
    shares = [
        part_shares(m, lab, len(parts))
        for m, lab in ((maps.query, labels_q), (maps.gallery, labels_g))
    ]
    mean_shares = ((shares[0] + shares[1]) / 2).numpy()
    out["object_share"] = 1 - mean_shares[:, 0]
    for k, name in enumerate(["background", *parts]):
        out[f"part_share_{name}"] = mean_shares[:, k]
    if (pairs.region > 0).all():
        region = torch.as_tensor(pairs.region)
        scored = [
            region_scores(m, lab, region)
            for m, lab in ((maps.query, labels_q), (maps.gallery, labels_g))
        ]
        out["discriminative_part_share"] = ((scored[0]["share"] + scored[1]["share"]) / 2).numpy()
        out["chance_part_share"] = ((scored[0]["chance"] + scored[1]["chance"]) / 2).numpy()
        out["pointing_game"] = ((scored[0]["pointing"] + scored[1]["pointing"]) / 2).numpy()
        within = [
            within_object_scores(m, lab, region)
            for m, lab in ((maps.query, labels_q), (maps.gallery, labels_g))
        ]
        for key in ("share", "chance", "pointing"):
            out[f"within_object_{key}"] = ((within[0][key] + within[1][key]) / 2).numpy()
    return out
