"""Explaining a finished run's similarities (``python -m harness explain --run RUN_ID``),
and scoring the explanations against ground truth and against the model.

For a finished run of any method, on its test split:

1. Pairs. On a dataset that records its classes' part attributes (``synthetic``),
   ``--pairs`` "near-miss" pairs: two images of two classes that differ in exactly one
   part (the ground truth of what tells them apart). Elsewhere, random test queries with
   their nearest neighbour by the embedding (the pairs retrieval puts first).
2. Maps, one per image of each pair, from two sources:

   * ``method``: the method's own (:meth:`harness.methods.PairExplainer.pair_maps`: A-grouping's and
     DIABLO's group maps, DIML's transport, AVSL's attribution, SAM's similarity attention);
     a method without maps is scored by the baseline only (one note line).
   * ``baseline``, for every run: similarity Grad-CAM of the embedding (Selvaraju et al.
     2017, Eq. 1-2, with the pair's cosine as the score, as in the comparison of the SAM
     paper, Sec. 4): the gradient of the pair's target score with respect to the last
     feature map the backbone hands to the head, weights = its spatial mean, ReLU of the
     weighted sum. The target is the cosine for a same-class pair and its negative (the
     distance, up to a constant) for a pair of two classes, as SAM's Siamese weights
     explain similarity and dissimilarity (Sec. 3.1.1); :meth:`~harness.methods.PairExplainer.pair_maps`
     follows the same rule.

3. Scores per pair, then mean and 95% t-interval over pairs (:mod:`harness.components.explanation.scores`):

   * with part masks: the share of each map inside the object (purity) and on each part,
     and for near-miss pairs the share on the differing part against its area share
     (chance) and the pointing game; each averaged over the pair's two images;
   * on any dataset: deletion and insertion curves of the pair's target score t
     (mapped to [0, 1] as (1 + t) / 2) when the query's pixels are removed or revealed
     most-attributed first in steps of 5% of the image, against the intact gallery image
     (perturbing both images would make two blanked images identical, similarity 1), and
     the same for two random orders: of the pixels, and of the cells of the model's last
     feature map (random values on its grid upsampled as the maps are: blobs of the same
     size as a map's, where scattered pixels keep a coarse picture of the whole image).
     Removed pixels take the value 0 of the normalised input, i.e. the protocol's mean
     colour (what SAM's masks do; a blur would keep the colours, which carry the class on
     ``synthetic``). Insertion reveals pixels on the query blurred (RISE's substrate,
     ``--insertion-canvas blur``) or on that mean colour (``mean``): on a flat canvas a
     random scatter of revealed pixels keeps a coarse picture of the whole image, which
     favours the random order (docs/performance.md measures both). AUCs by the
     trapezoidal rule.

Written: ``--json`` (scores), figures under ``--out`` (the method's own figures in its
paper's style where it has them, the pairs with both maps, the curves), and, on the run in
the tracking store, the figures as artifacts under ``explain/`` and the scores as
``explain/<source>_<score>`` metrics (``_lo`` / ``_hi``: the interval).

The run, the pairs and the maps are :mod:`harness.engine.explain.maps`'s; this module scores
them, draws the figures and records the explanation.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from harness.base.atomic import finite_json
from harness.base.metric_keys import metric_key
from harness.components.explanation.curve_settings import CURVE_PAIRS
from harness.components.explanation.maps import attention_figure
from harness.components.explanation.sanity import random_maps
from harness.components.explanation.scores import (
    STEP,
    curve_auc,
    mean_interval,
    perturbation_curves,
    random_scores,
)
from harness.engine.explain.maps import (
    PairMaps,
    Pairs,
    RunContext,
    compute_maps,
    load_images,
    near_miss_pairs,
    neighbour_pairs,
    part_labels,
    to_pictures,
)
from harness.engine.explain.parts import part_scores
from harness.engine.explain.sanity import (
    feature_grid,
    randomised_scores,
    reference_maps,
    sanity_metrics,
    sanity_verdicts,
)
from harness.methods import Explainer, HeadOutput
from harness.reports.explanations import curves_figure, pairs_figure, write_tuple_figures
from harness.store.queries import log_to_run

__all__ = [
    "explain_run",
    "record_to_run",
    "SCORE_KEYS",
]

#: The scores every source reports (with part masks; the last six on any dataset).
SCORE_KEYS = (
    "within_object_share",
    "within_object_chance",
    "within_object_pointing",
    "pointing_game",
    "discriminative_part_share",
    "chance_part_share",
    "object_share",
    "deletion_auc",
    "insertion_auc",
    "random_deletion_auc",
    "random_insertion_auc",
    "random_cells_deletion_auc",
    "random_cells_insertion_auc",
)
#: Images per forward pass of the perturbation curves, and pairs per forward and backward
#: pass of the maps. Small on purpose: on CPU, time per image grows with the batch once the
#: activations leave the cache. Measured on 2 cores (DIABLO N = 16, whose psi runs on 16
#: maps per image): 38 ms per image at batch 8 and 68-82 at 128-256; Grad-CAM 165-170 ms
#: per pair at 4-8 pairs, 545-670 at 32-64. ``plain`` is flat (4-6 ms) from 8 to 128.
PERTURB_BATCH = 16
MAPS_BATCH = 8
#: Test images per forward pass when embedding the test set (neighbour pairs).
EMBED_BATCH = 32


# ------------------------------------------------------------------------ scores


def _empty_maps(sources: dict[str, PairMaps]) -> str:
    counts = {
        name: int((m.query.flatten(1).sum(1) <= 0).sum() + (m.gallery.flatten(1).sum(1) <= 0).sum())
        for name, m in sources.items()
    }
    return ", ".join(f"{name} {count}" for name, count in counts.items() if count)


def _curves(
    ctx: RunContext,
    pairs: Pairs,
    order_maps: dict[str, torch.Tensor],
    gallery_emb: torch.Tensor,
    seed: int,
    batch: int,
    canvas: str,
) -> dict[str, dict[str, np.ndarray]]:
    """:func:`~harness.components.explanation.scores.perturbation_curves` of the pairs' query
    side for each pixel order in ``order_maps`` (name -> P x H x W), insertion on
    ``canvas``: name -> {"fractions", "deletion", "insertion"} (P x S each)."""
    generator = torch.Generator().manual_seed(seed)
    queries = load_images(ctx, pairs.query)
    same = torch.as_tensor(pairs.same)

    def embed(images):
        return ctx.model(images.contiguous(memory_format=torch.channels_last)).embedding

    out = {}
    with tqdm(
        total=len(queries) * len(order_maps),
        desc="explain: deletion/insertion curves",
        unit="pair",
        leave=False,
        disable=None,
        file=sys.stderr,
    ) as bar:
        for name, scores in order_maps.items():
            fractions, deletion, insertion = perturbation_curves(
                embed,
                queries,
                gallery_emb,
                same,
                scores,
                generator=generator,
                batch=batch,
                on_chunk=bar.update,
                canvas=canvas,
            )
            out[name] = {
                "fractions": fractions.numpy(),
                "deletion": deletion.numpy(),
                "insertion": insertion.numpy(),
            }
    return out


#: Scores outside [0, 1], with the bounds their intervals are clipped to.
_SCORE_BOUNDS = {"rank_correlation": (-1.0, 1.0)}


def _summary(per_pair: dict[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, values in per_pair.items():
        mean, lo, hi = mean_interval(values, bounds=_SCORE_BOUNDS.get(key, (0.0, 1.0)))
        out[key] = mean
        out[f"{key}_ci95"] = [lo, hi]
    return out


def _method_figures(ctx: RunContext, pairs: Pairs, out_dir: Path) -> list[Path]:
    """The method's own figures, in its paper's style: its per-image maps (A-grouping Figs.
    3-4 layout, :func:`~harness.components.explanation.maps.attention_figure`) and its pair figure (DIML Fig. 5,
    SAM Fig. 4) for the first pair."""

    written = []
    images = load_images(ctx, pairs.query[:16])
    with torch.no_grad():
        out = ctx.model(images)
        head = ctx.model.head
        maps = head.explain(images, out) if isinstance(head, Explainer) else None
    pictures = to_pictures(ctx, images)
    if maps is not None:
        rank = out.attention.amax(dim=(2, 3)).cpu() if out.attention is not None else "mass"
        title = f"{ctx.method}, run {ctx.run_id[:8]}: maps on {len(images)} query images"
        written.append(
            attention_figure(pictures, maps.cpu(), out_dir / "maps.png", rank_by=rank, title=title)
        )
    q, g = load_images(ctx, pairs.query[:1]), load_images(ctx, pairs.gallery[:1])
    with torch.no_grad():
        oq, og = ctx.model(q), ctx.model(g)

    # the pair figure gets outputs without extras (as log_explanations passes them)
    def bare(out):
        return HeadOutput(**{k: v for k, v in vars(out).items() if k != "extras"})

    pictures_pair = [to_pictures(ctx, q)[0], to_pictures(ctx, g)[0]]
    return written + write_tuple_figures(
        ctx.model.head,
        "pair",
        pictures_pair,
        [bare(oq), bare(og)],
        out_dir,
        caption=f"{ctx.method}, run {ctx.run_id[:8]}, the first pair",
    )


# ------------------------------------------------------------------------ the explanation


def _first(pairs: Pairs, count: int) -> Pairs:
    return Pairs(
        pairs.query[:count],
        pairs.gallery[:count],
        pairs.same[:count],
        pairs.region[:count],
        pairs.kind,
    )


def _sources(
    ctx: RunContext, chosen: Pairs, batch: int, notes: list[str]
) -> tuple[dict[str, PairMaps], torch.Tensor]:
    """The maps of every source (the method's own, when it has them, and the baseline),
    and the gallery images' embeddings; a note where the method has no maps."""
    method_maps, baseline_maps, _, emb_g = compute_maps(ctx, chosen, batch)
    if method_maps is None:
        notes.append(
            f"method '{ctx.method}' has no explanation maps of its own (no pair_maps): "
            f"only the Grad-CAM baseline is scored"
        )
        return {"baseline": baseline_maps}, emb_g
    return {"method": method_maps, "baseline": baseline_maps}, emb_g


def explain_run(
    ctx: RunContext,
    *,
    pairs: int = 200,
    curve_pairs: int = CURVE_PAIRS,
    seed: int = 0,
    out_dir: Path,
    batch: int = MAPS_BATCH,
    figures: bool = True,
    sanity: bool = False,
    canvas: str = "blur",
) -> dict[str, Any]:
    """Everything ``explain`` computes for one rebuilt run; returns the JSON record.
    Maps and part scores cover all ``pairs``; the deletion / insertion curves the first
    ``curve_pairs`` of them (each costs 2 x 19 + 1 forward passes per pixel order).
    ``sanity``: also the ceiling, the floors and the cascading randomisation
    (:mod:`harness.engine.explain.sanity`), under ``sanity`` and ``sanity_verdicts``;
    ``canvas``: what insertion reveals pixels on
    (:data:`~harness.components.explanation.curve_settings.CANVASES`)."""
    started = time.perf_counter()
    notes: list[str] = []
    rng = np.random.default_rng(seed)
    chosen = near_miss_pairs(ctx, pairs, rng)
    if chosen is None:
        chosen = neighbour_pairs(ctx, pairs, rng, EMBED_BATCH)
    sources, emb_g = _sources(ctx, chosen, batch, notes)
    per_pair: dict[str, dict[str, np.ndarray]] = {name: {} for name in sources}
    empty = _empty_maps(sources)
    if empty:
        notes.append(
            f"maps with no mass at all (scored as uniform), of {2 * len(chosen.query)} per source: {empty}"
        )
    notes += _score_parts(ctx, chosen, sources, per_pair)
    m = min(curve_pairs, len(chosen.query))  # the first m pairs (in random order already)
    curves = _score_curves(ctx, _first(chosen, m), sources, emb_g[:m], per_pair, seed, canvas)
    figures_written = _write_figures(ctx, chosen, sources, curves, out_dir) if figures else []
    checks = _sanity_checks(ctx, chosen, sources, per_pair, seed, batch) if sanity else None
    return {
        "run_id": ctx.run_id,
        "method_name": ctx.method,
        "dataset": ctx.dataset,
        "protocol": ctx.protocol.name,
        "fingerprint": ctx.tags.get("fingerprint", ""),
        "pairs": len(chosen.query),
        "curve_pairs": m,
        "pair_kind": chosen.kind,
        "seed": seed,
        "step": STEP,
        "removal": "normalised input set to 0 (the protocol's mean colour), query side",
        "insertion_canvas": canvas,
        "method": _summary(per_pair["method"]) if "method" in per_pair else None,
        "baseline": _summary(per_pair["baseline"]),
        "baseline_kind": "similarity Grad-CAM of the embedding (last feature map)",
        "notes": notes,
        **(_sanity_record(ctx, per_pair, checks) if checks is not None else {}),
        "figures": [str(p) for p in figures_written],
        "seconds": time.perf_counter() - started,
    }


def _score_parts(
    ctx: RunContext,
    chosen: Pairs,
    sources: dict[str, PairMaps],
    per_pair: dict[str, dict[str, np.ndarray]],
) -> list[str]:
    """The part-mask scores of each source's maps into ``per_pair``; returns the notes on
    what a dataset without part masks or near-miss classes leaves out."""
    labels_q, labels_g = part_labels(ctx, chosen.query), part_labels(ctx, chosen.gallery)
    parts = list(ctx.splits.extras.get("parts", []))
    if labels_q is None or not parts:
        return [
            f"dataset '{ctx.dataset}' has no part masks: pointing game and part shares are left out, "
            f"deletion and insertion only"
        ]
    assert labels_g is not None  # the same masks as labels_q
    notes = []
    if chosen.kind != "near-miss":
        notes.append(
            f"dataset '{ctx.dataset}' records no near-miss classes: part shares only, no "
            f"pointing game or discriminative part share"
        )
    for name, maps in sources.items():
        per_pair[name].update(part_scores(maps, labels_q, labels_g, chosen, parts))
    return notes


def _sanity_checks(
    ctx: RunContext,
    chosen: Pairs,
    sources: dict[str, PairMaps],
    per_pair: dict[str, dict[str, np.ndarray]],
    seed: int,
    batch: int,
) -> dict[str, dict[str, np.ndarray]]:
    """Per pair, the scores of the ceiling and floors (with part masks) and of each
    source's maps under the cascading randomisation (:mod:`harness.engine.explain.sanity`)."""
    labels_q, labels_g = part_labels(ctx, chosen.query), part_labels(ctx, chosen.gallery)
    parts = list(ctx.splits.extras.get("parts", []))
    labels = (
        (labels_q, labels_g) if labels_q is not None and labels_g is not None and parts else None
    )
    checks: dict[str, dict[str, np.ndarray]] = {}
    if labels is not None:
        grid = feature_grid(ctx, chosen)
        for name, maps in reference_maps(*labels, chosen, grid, seed).items():
            checks[name] = part_scores(maps, *labels, chosen, parts)
    checks.update(randomised_scores(ctx, chosen, sources, labels, parts, seed=seed, batch=batch))
    return checks


def _sanity_record(
    ctx: RunContext,
    per_pair: dict[str, dict[str, np.ndarray]],
    checks: dict[str, dict[str, np.ndarray]],
) -> dict[str, Any]:
    lr_backbone = float(ctx.protocol.optimizer.lr_backbone)
    return {
        "sanity": {name: _summary(scores) for name, scores in checks.items()},
        "sanity_verdicts": sanity_verdicts(per_pair, checks, lr_backbone=lr_backbone),
    }


def _score_curves(
    ctx: RunContext,
    chosen: Pairs,
    sources: dict[str, PairMaps],
    emb_g,
    per_pair: dict[str, dict[str, np.ndarray]],
    seed: int,
    canvas: str,
) -> dict[str, Any]:
    """Deletion and insertion curves of ``chosen`` in each source's pixel order, in a
    random one and in a random order of the model's grid cells (insertion on ``canvas``);
    each source's areas under them (and the two random orders') into ``per_pair``."""
    size = ctx.protocol.image.size
    m = len(chosen.query)
    orders = {name: maps.query[:m] for name, maps in sources.items()}
    orders["random"] = random_scores((m, size, size), torch.Generator().manual_seed(seed + 1))
    # Random pixels scattered over the image keep a coarse picture of all of it; a map on
    # the model's grid reveals blobs. Random values on that grid, upsampled as the maps
    # are, are the reference of the same granularity.
    cells = torch.Generator().manual_seed(seed + 3)
    orders["random_cells"] = random_maps((m, size, size), feature_grid(ctx, chosen), cells)
    curves = _curves(ctx, chosen, orders, emb_g, seed, batch=PERTURB_BATCH, canvas=canvas)

    def auc(order: str, kind: str) -> np.ndarray:
        values, fractions = curves[order][kind], curves[order]["fractions"]
        return curve_auc(torch.as_tensor(values), torch.as_tensor(fractions)).numpy()

    for name in sources:
        for kind in ("deletion", "insertion"):
            per_pair[name][f"{kind}_auc"] = auc(name, kind)
            per_pair[name][f"random_{kind}_auc"] = auc("random", kind)
            per_pair[name][f"random_cells_{kind}_auc"] = auc("random_cells", kind)
    return curves


def _write_figures(
    ctx: RunContext,
    chosen: Pairs,
    sources: dict[str, PairMaps],
    curves: dict[str, Any],
    out_dir: Path,
) -> list[Path]:
    """The first pairs with their maps, the curves, and the method's own figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    caption = f"{ctx.method}, {ctx.dataset}, run {ctx.run_id[:8]}"
    show = min(6, len(chosen.query))
    parts_named = ["", *ctx.splits.extras.get("parts", [])]
    notes_rows = [
        f"{'same' if chosen.same[i] else 'differ'}"
        + (f": {parts_named[chosen.region[i]]}" if chosen.region[i] else "")
        for i in range(show)
    ]
    written = [
        pairs_figure(
            out_dir / "pairs.png",
            to_pictures(ctx, load_images(ctx, chosen.query[:show])),
            to_pictures(ctx, load_images(ctx, chosen.gallery[:show])),
            {k: PairMaps(v.query[:show], v.gallery[:show]) for k, v in sources.items()},
            notes_rows,
            title=f"{caption}: the first {show} pairs",
        ),
        curves_figure(
            out_dir / "curves.png", curves, title=f"{caption}: mean over {len(chosen.query)} pairs"
        ),
    ]
    return written + _method_figures(ctx, chosen, out_dir)


def record_to_run(ctx: RunContext, record: dict[str, Any]) -> None:
    """The explanation on its run in the tracking store: the scores as
    ``explain/<source>_<score>`` metrics (``_lo`` / ``_hi``: the interval), the sanity
    checks' (:func:`~harness.engine.explain.sanity.sanity_metrics`), the pair kind,
    seed and notes as tags, ``explain/scores.json`` and the figures under ``explain/``."""

    metrics = {
        metric_key("explain", "pairs"): float(record["pairs"]),
        metric_key("explain", "curve_pairs"): float(record["curve_pairs"]),
    }
    for source in ("method", "baseline"):
        scores = record.get(source)
        for key, value in (scores or {}).items():
            if key.endswith("_ci95"):
                base = key.removesuffix("_ci95")
                (
                    metrics[metric_key("explain", f"{source}_{base}_lo")],
                    metrics[metric_key("explain", f"{source}_{base}_hi")],
                ) = value
            else:
                metrics[metric_key("explain", f"{source}_{key}")] = value
    metrics.update(sanity_metrics(record))
    log_to_run(
        ctx.run_id,
        metrics={k: v for k, v in metrics.items() if v is not None and np.isfinite(v)},
        tags={
            "explain_pair_kind": record["pair_kind"],
            "explain_seed": str(record["seed"]),
            "explain_insertion_canvas": record["insertion_canvas"],
            "explain_notes": "; ".join(record["notes"])[:5000] or "none",
        },
        texts={"explain/scores.json": json.dumps(finite_json(record), indent=2, allow_nan=False)},
        artifacts=[(Path(f), "explain") for f in record["figures"]],
    )
