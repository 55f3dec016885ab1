"""The sanity checks of ``python -m harness explain --sanity``: beside a run's own maps and
its Grad-CAM baseline, the maps every score is read against (Adebayo et al., "Sanity
Checks for Saliency Maps", NeurIPS 2018; :mod:`harness.components.explanation.sanity`).

* ``ground_truth``, the ceiling: the differing part's mask blurred to one cell of the
  model's last feature map (near-miss pairs on a dataset with part masks);
* ``uniform`` and ``random``, the floors: a flat map and random values on the model's grid;
* ``randomised <point>``, each source's maps after the cascading randomisation of the
  trained weights, top layers first (Sec. 3.1): the head, then the backbone's points from
  the last to the first, each stage keeping the layers destroyed before it. Each stage
  scores the part shares and the rank correlation with the trained model's map.

Two verdicts per source (:func:`sanity_verdicts`): whether its maps beat the random map
beyond both 95% intervals (the differing-part share with part masks; else the deletion
AUC against the random pixel order), and whether they change under randomisation (the
95% interval of the rank correlation with the fully randomised model's maps lies below
:data:`~harness.components.explanation.sanity.UNCHANGED_CORRELATION`).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from harness.base.metric_keys import metric_key
from harness.components.explanation.sanity import (
    UNCHANGED_CORRELATION,
    ground_truth_maps,
    random_maps,
    randomisation_stages,
    randomise_,
    rank_correlation,
    uniform_maps,
)
from harness.components.explanation.scores import mean_interval
from harness.engine.explain_maps import PairMaps, Pairs, RunContext, compute_maps, load_images
from harness.engine.explain_parts import part_scores

__all__ = [
    "feature_grid",
    "reference_maps",
    "randomised_scores",
    "sanity_verdicts",
    "sanity_metrics",
    "SANITY_SCORES",
]

#: The scores of each sanity row that are printed and logged.
SANITY_SCORES = (
    "pointing_game",
    "discriminative_part_share",
    "object_share",
    "rank_correlation",
)


def feature_grid(ctx: RunContext, pairs: Pairs) -> int:
    """The side of the last feature map the backbone hands the head (its map's grid)."""
    with torch.no_grad():
        return int(ctx.model.backbone(load_images(ctx, pairs.query[:1]))[-1].shape[-1])


def reference_maps(
    labels_q: torch.Tensor, labels_g: torch.Tensor, pairs: Pairs, grid: int, seed: int
) -> dict[str, PairMaps]:
    """The ceiling and the floors for ``pairs`` at image size (``labels_*``: their part
    masks), on a feature map of ``grid`` x ``grid``: ``ground_truth`` (near-miss pairs
    only), ``uniform`` and ``random`` (drawn from ``seed``)."""
    shape = tuple(labels_q.shape)
    generator = torch.Generator().manual_seed(seed + 2)
    out = {
        "uniform": PairMaps(uniform_maps(shape), uniform_maps(shape)),  # type: ignore[arg-type]
        "random": PairMaps(
            random_maps(shape, grid, generator),  # type: ignore[arg-type]
            random_maps(shape, grid, generator),  # type: ignore[arg-type]
        ),
    }
    if (pairs.region > 0).all():
        region, cell = torch.as_tensor(pairs.region), shape[-1] / grid
        out = {
            "ground_truth": PairMaps(
                ground_truth_maps(labels_q, region, cell), ground_truth_maps(labels_g, region, cell)
            ),
            **out,
        }
    return out


def randomised_scores(
    ctx: RunContext,
    pairs: Pairs,
    trained: dict[str, PairMaps],
    labels: tuple[torch.Tensor, torch.Tensor] | None,
    parts: list[str],
    *,
    seed: int,
    batch: int,
) -> dict[str, dict[str, np.ndarray]]:
    """Per pair, the scores of each source's maps at each stage of the cascade
    (``randomised <point> (<source>)``): the part scores where ``labels`` are given, and
    ``rank_correlation`` with the trained model's map of the same source (the mean over
    the pair's two images). The model is copied to the CPU, randomised there from
    ``seed`` (the same draws on every device), and moved back for each stage's maps."""
    model = copy.deepcopy(ctx.model).cpu()
    generator = torch.Generator().manual_seed(seed + 3)
    backbone = model.backbone
    out: dict[str, dict[str, np.ndarray]] = {}
    for point, modules in randomisation_stages(model.head, backbone.body, backbone.spec.points):
        randomise_(modules, generator)
        staged = replace(ctx, model=copy.deepcopy(model).to(ctx.device).eval())
        own, baseline, _, _ = compute_maps(staged, pairs, batch)
        for source, maps in (("method", own), ("baseline", baseline)):
            if source not in trained or maps is None:
                continue
            scores = part_scores(maps, *labels, pairs, parts) if labels is not None else {}
            before = trained[source]
            scores["rank_correlation"] = (
                (
                    rank_correlation(before.query, maps.query)
                    + rank_correlation(before.gallery, maps.gallery)
                )
                / 2
            ).numpy()
            out[f"randomised {point} ({source})"] = scores
    return out


def _interval(per_pair: dict[str, np.ndarray], key: str) -> tuple[float, float, float]:
    if key not in per_pair:
        return (np.nan, np.nan, np.nan)
    return mean_interval(
        per_pair[key], bounds=(-1.0, 1.0) if key == "rank_correlation" else (0.0, 1.0)
    )


def sanity_verdicts(
    sources: dict[str, dict[str, np.ndarray]], checks: dict[str, dict[str, np.ndarray]]
) -> dict[str, dict[str, Any]]:
    """For each source (``method``, ``baseline``): ``beats_random`` and
    ``changes_under_randomisation`` (None where the check has nothing to read), with the
    score each verdict was read from."""
    out: dict[str, dict[str, Any]] = {}
    random = checks.get("random", {})
    for source, scores in sources.items():
        if "discriminative_part_share" in scores and "discriminative_part_share" in random:
            own, floor = (
                _interval(scores, "discriminative_part_share"),
                _interval(random, "discriminative_part_share"),
            )
            beats, read = own[1] > floor[2], "discriminative_part_share"
        elif "deletion_auc" in scores:
            own, floor = _interval(scores, "deletion_auc"), _interval(scores, "random_deletion_auc")
            beats, read = own[2] < floor[1], "deletion_auc"
        else:
            beats, read = None, ""
        stages = [k for k in checks if k.startswith("randomised ") and k.endswith(f"({source})")]
        changes = None
        if stages:  # the last stage: every layer re-initialised
            corr = _interval(checks[stages[-1]], "rank_correlation")
            changes = bool(corr[2] < UNCHANGED_CORRELATION) if np.isfinite(corr[2]) else None
        out[source] = {
            "beats_random": None if beats is None else bool(beats),
            "beats_random_by": read,
            "changes_under_randomisation": changes,
            "fully_randomised": stages[-1] if stages else "",
        }
    return out


def sanity_slug(row: str) -> str:
    """A sanity row's name as a metric key part: ``randomised s32 (method)`` ->
    ``randomised_s32_method``."""
    return "_".join(row.replace("(", " ").replace(")", " ").split())


def sanity_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The sanity checks of an ``explain`` record as metrics: each row's
    :data:`SANITY_SCORES` as ``explain/sanity_<row>_<score>`` (``_lo`` / ``_hi``: the
    interval) and each verdict as ``explain/<source>_beats_random`` and
    ``explain/<source>_changes_under_randomisation`` (1 or 0)."""
    out: dict[str, float] = {}
    for row, scores in (record.get("sanity") or {}).items():
        for score in SANITY_SCORES:
            if score not in scores:
                continue
            key = f"sanity_{sanity_slug(row)}_{score}"
            out[metric_key("explain", key)] = scores[score]
            lo, hi = scores[f"{score}_ci95"]
            out[metric_key("explain", f"{key}_lo")], out[metric_key("explain", f"{key}_hi")] = (
                lo,
                hi,
            )
    for source, verdict in (record.get("sanity_verdicts") or {}).items():
        for check in ("beats_random", "changes_under_randomisation"):
            if verdict.get(check) is not None:
                out[metric_key("explain", f"{source}_{check}")] = float(verdict[check])
    return out
