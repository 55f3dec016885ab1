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

Three verdicts per source (:func:`sanity_verdicts`), each a paired 95% t-interval over
the pairs (the same pairs score every map):

* ``beats_chance``: the differing part's share within the object exceeds its chance (the
  part's area over the object's, what the uniform-on-object map scores) with the
  interval of the per-pair difference above 0; without part masks, the deletion AUC below
  the random order of the map's cells;
* ``changes_under_randomisation``: the 95% interval of the rank correlation with the
  fully randomised model's map lies below
  :data:`~harness.components.explanation.sanity.UNCHANGED_CORRELATION`;
* ``uses_training``: the within-object share drops, interval of the per-pair drop above
  0, once every part the protocol trains is re-drawn (the head, and the backbone when its
  rate is above 0): a map that keeps its score there reads the architecture or the
  pretrained weights, not what this run learned (Adebayo et al., Sec. 3.1).
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
    uniform_on_object_maps,
)
from harness.components.explanation.scores import mean_interval
from harness.engine.explain.maps import PairMaps, Pairs, RunContext, compute_maps, load_images
from harness.engine.explain.parts import part_scores

__all__ = [
    "feature_grid",
    "reference_maps",
    "randomised_scores",
    "sanity_verdicts",
    "sanity_metrics",
    "trained_parts_stage",
    "SANITY_SCORES",
]

#: The scores of each sanity row that are printed and logged.
SANITY_SCORES = (
    "within_object_share",
    "within_object_pointing",
    "pointing_game",
    "discriminative_part_share",
    "object_share",
    "rank_correlation",
)

#: The verdicts of each source, logged as ``explain/<source>_<verdict>`` (1 or 0).
VERDICTS = ("beats_chance", "changes_under_randomisation", "uses_training")


def feature_grid(ctx: RunContext, pairs: Pairs) -> int:
    """The side of the last feature map the backbone hands the head (its map's grid)."""
    with torch.no_grad():
        return int(ctx.model.backbone(load_images(ctx, pairs.query[:1]))[-1].shape[-1])


def reference_maps(
    labels_q: torch.Tensor, labels_g: torch.Tensor, pairs: Pairs, grid: int, seed: int
) -> dict[str, PairMaps]:
    """The ceiling and the floors for ``pairs`` at image size (``labels_*``: their part
    masks), on a feature map of ``grid`` x ``grid``: ``ground_truth`` and
    ``uniform_on_object`` (near-miss pairs only), ``uniform`` and ``random`` (drawn from
    ``seed``)."""
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
            "uniform_on_object": PairMaps(
                uniform_on_object_maps(labels_q),
                uniform_on_object_maps(labels_g),
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


def _paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """Mean and 95% t-interval over pairs of ``a - b`` (two scores of the same pairs)."""
    n = min(len(a), len(b))
    return mean_interval(np.asarray(a[:n]) - np.asarray(b[:n]), bounds=(-1.0, 1.0))


def trained_parts_stage(lr_backbone: float, stages: list[str]) -> str:
    """The step of the cascade (``stages``, top first) at which every part the protocol
    trains has been re-drawn: the head when the backbone's rate is 0, else the last step."""
    if not stages:
        return ""
    return stages[0] if lr_backbone <= 0 else stages[-1]


def _beats_chance(scores: dict[str, np.ndarray]) -> tuple[bool | None, str, list[float]]:
    """Whether a source's maps beat chance (see the module docstring), the score read, and
    the paired difference (mean, lo, hi) it was read from."""
    if "within_object_share" in scores:
        diff = _paired(scores["within_object_share"], scores["within_object_chance"])
        return bool(diff[1] > 0), "within_object_share", list(diff)
    if "deletion_auc" in scores:
        diff = _paired(scores["random_cells_deletion_auc"], scores["deletion_auc"])
        return bool(diff[1] > 0), "deletion_auc", list(diff)
    return None, "", [np.nan] * 3


def sanity_verdicts(
    sources: dict[str, dict[str, np.ndarray]],
    checks: dict[str, dict[str, np.ndarray]],
    *,
    lr_backbone: float,
) -> dict[str, dict[str, Any]]:
    """For each source (``method``, ``baseline``) the :data:`VERDICTS` (None where the check
    has nothing to read), with the rows and the paired differences each was read from;
    ``lr_backbone``: the protocol's backbone rate (whether the backbone is a trained part)."""
    out: dict[str, dict[str, Any]] = {}
    for source, scores in sources.items():
        beats, read, difference = _beats_chance(scores)
        stages = [k for k in checks if k.startswith("randomised ") and k.endswith(f"({source})")]
        changes = None
        if stages:  # the last stage: every layer re-initialised
            corr = _interval(checks[stages[-1]], "rank_correlation")
            changes = bool(corr[2] < UNCHANGED_CORRELATION) if np.isfinite(corr[2]) else None
        trained = trained_parts_stage(lr_backbone, stages)
        uses, drop = None, [np.nan] * 3
        if trained and "within_object_share" in scores:
            drop = list(
                _paired(scores["within_object_share"], checks[trained]["within_object_share"])
            )
            uses = bool(drop[1] > 0)
        out[source] = {
            "beats_chance": beats,
            "beats_chance_by": read,
            "beats_chance_difference": difference,
            "changes_under_randomisation": changes,
            "fully_randomised": stages[-1] if stages else "",
            "uses_training": uses,
            "trained_parts_randomised": trained,
            "training_drop": drop,
        }
    return out


def sanity_slug(row: str) -> str:
    """A sanity row's name as a metric key part: ``randomised s32 (method)`` ->
    ``randomised_s32_method``."""
    return "_".join(row.replace("(", " ").replace(")", " ").split())


def sanity_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The sanity checks of an ``explain`` record as metrics: each row's
    :data:`SANITY_SCORES` as ``explain/sanity_<row>_<score>`` (``_lo`` / ``_hi``: the
    interval), each verdict as ``explain/<source>_<verdict>`` (1 or 0), and the
    within-object share once the trained parts are re-drawn as
    ``explain/<source>_trained_parts_randomised_within_object_share`` (with its interval)."""
    out: dict[str, float] = {}
    sanity = record.get("sanity") or {}
    for row, scores in sanity.items():
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
        for check in VERDICTS:
            if verdict.get(check) is not None:
                out[metric_key("explain", f"{source}_{check}")] = float(verdict[check])
        row = sanity.get(verdict.get("trained_parts_randomised", ""), {})
        if "within_object_share" in row:
            key = f"{source}_trained_parts_randomised_within_object_share"
            out[metric_key("explain", key)] = row["within_object_share"]
            lo, hi = row["within_object_share_ci95"]
            out[metric_key("explain", f"{key}_lo")], out[metric_key("explain", f"{key}_hi")] = (
                lo,
                hi,
            )
    return out
