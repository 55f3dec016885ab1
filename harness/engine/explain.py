"""Explaining a finished run's similarities (``python -m harness explain --run RUN_ID``),
and scoring the explanations against ground truth and against the model.

For a finished run of any method, on its test split:

1. Pairs. On a dataset that records its classes' part attributes (``synthetic``),
   ``--pairs`` "near-miss" pairs: two images of two classes that differ in exactly one
   part (the ground truth of what tells them apart). Elsewhere, random test queries with
   their nearest neighbour by the embedding (the pairs retrieval puts first).
2. Maps, one per image of each pair, from two sources:

   * ``method``: the method's own (:meth:`methods.Method.pair_maps`: A-grouping's and
     DIABLO's group maps, DIML's transport, AVSL's attribution, SAM's similarity attention);
     a method without maps is scored by the baseline only (one note line).
   * ``baseline``, for every run: similarity Grad-CAM of the embedding (Selvaraju et al.
     2017, Eq. 1-2, with the pair's cosine as the score, as in the comparison of the SAM
     paper, Sec. 4): the gradient of the pair's target score with respect to the last
     feature map the backbone hands to the head, weights = its spatial mean, ReLU of the
     weighted sum. The target is the cosine for a same-class pair and its negative (the
     distance, up to a constant) for a pair of two classes, as SAM's Siamese weights
     explain similarity and dissimilarity (Sec. 3.1.1); :meth:`~methods.Method.pair_maps`
     follows the same rule.

3. Scores per pair, then mean and 95% t-interval over pairs (:mod:`harness.components.explanation.scores`):

   * with part masks: the share of each map inside the object (purity) and on each part,
     and for near-miss pairs the share on the differing part against its area share
     (chance) and the pointing game; each averaged over the pair's two images;
   * on any dataset: deletion and insertion curves of the pair's target score t
     (mapped to [0, 1] as (1 + t) / 2) when the query's pixels are removed or revealed
     most-attributed first in steps of 5% of the image, against the intact gallery image
     (perturbing both images would make two blanked images identical, similarity 1), and
     the same for a random pixel order. Removed pixels take the value 0 of the normalised
     input, i.e. the protocol's mean colour (what SAM's masks do; a blur would keep the
     colours, which carry the class on ``synthetic``). AUCs by the trapezoidal rule.

Written: ``--json`` (scores), figures under ``--out`` (the method's own figures in its
paper's style where it has them, the pairs with both maps, the curves), and, on the run in
the tracking store, the figures as artifacts under ``explain/`` and the scores as
``explain/<source>_<score>`` metrics (``_lo`` / ``_hi``: the interval).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from harness.base.atomic import finite_json
from harness.base.errors import HarnessError
from harness.base.metric_keys import metric_key
from harness.components.explanation.scores import (
    STEP,
    curve_auc,
    mean_interval,
    part_shares,
    perturbation_curves,
    random_scores,
    region_scores,
)
from harness.reports.explanations import curves_figure, pairs_figure, write_tuple_figures

__all__ = [
    "RunContext",
    "load_run",
    "similarity_gradcam",
    "near_miss_class_pairs",
    "explain_run",
    "record_to_run",
    "output_rows",
    "SCORE_KEYS",
    "CURVE_PAIRS",
]

#: The scores every source reports (with part masks; the last four on any dataset).
SCORE_KEYS = (
    "pointing_game",
    "discriminative_part_share",
    "chance_part_share",
    "object_share",
    "deletion_auc",
    "insertion_auc",
    "random_deletion_auc",
    "random_insertion_auc",
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
#: Pairs whose deletion / insertion curves are measured by default: each pair costs 19
#: inner steps x (deletion, insertion) + 1 intact image, x 3 pixel orders = 117 forward
#: passes, so 48 pairs take 5,616, the bulk of the command's time on a CPU
#: (``--curve-pairs`` sets it).
CURVE_PAIRS = 48


# ------------------------------------------------------------------------ the run


@dataclass
class RunContext:
    """A finished run rebuilt from the store: its model (selected weights), protocol and
    splits (checked against the split digest it recorded)."""

    run_id: str
    method: str
    dataset: str
    protocol: Any
    splits: Any
    model: Any
    device: torch.device
    tags: dict[str, str]


def _finished_run(run_id: str):
    from harness.store.queries import find_run
    from harness.store.tracking import tracking_uri

    run = find_run(run_id)
    if run is None:
        raise HarnessError(
            f"explain: no run '{run_id}' in the tracking store {tracking_uri()} "
            f"(give a run id from the MLflow UI or a run --json record's mlflow_run_id)"
        )
    if run.info.status != "FINISHED":
        raise HarnessError(
            f"explain: run '{run_id}' is {run.info.status}, not FINISHED: it has no selected weights"
        )
    missing = [t for t in ("method", "dataset", "seed") if t not in run.data.tags]
    if missing:
        raise HarnessError(
            f"explain: run '{run_id}' is not a harness training run (no {', '.join(missing)} tag)"
        )
    return run


def _run_protocol(run_id: str):
    from harness.config.protocol import protocol_from_dict
    from harness.store.queries import read_artifact

    try:
        data = read_artifact(
            run_id,
            "protocol/resolved.json",
            lambda path: json.loads(path.read_text(encoding="utf-8")),
        )
        if data is None:
            raise FileNotFoundError("protocol/resolved.json")
    except Exception as err:
        raise HarnessError(
            f"explain: run '{run_id}' has no readable protocol/resolved.json artifact "
            f"({type(err).__name__})"
        ) from None
    return protocol_from_dict(data)


def load_run(
    run_id: str,
    *,
    data_root: Path | None = None,
    checkpoint_root: Path | None = None,
    device: str = "auto",
) -> RunContext:
    """Rebuild a finished run: protocol from its ``protocol/resolved.json``, splits (the
    digest must match the recorded one), model with its selected weights (as
    ``run --evaluate-only --init-from`` does)."""
    from harness.engine.training import (
        build_model,
        default_checkpoint_root,
        prepare_splits,
        resolve_device,
    )
    from harness.store.tracking import load_finished_weights

    run = _finished_run(run_id)
    tags = run.data.tags
    protocol = _run_protocol(run_id)
    method, dataset = tags["method"], tags["dataset"]
    from methods import METHODS

    if method not in METHODS:
        raise HarnessError(
            f"explain: run '{run_id}' is of method '{method}', which this code does not register"
        )
    splits = prepare_splits(protocol, dataset, data_root, seed=int(tags["seed"]))
    recorded = tags.get("split_digest", "")
    if recorded and splits.digest() != recorded:
        raise HarnessError(
            f"explain: the {dataset} splits found now (digest {splits.digest()}) are not the ones run "
            f"'{run_id}' was tested on ({recorded}); point --data-root at that dataset"
        )
    model = build_model(protocol, method, dict(protocol.methods.get(method, {})))
    load_finished_weights(
        model, run_id, flag="explain", checkpoint_root=checkpoint_root or default_checkpoint_root()
    )
    dev = resolve_device(device)
    # Channels-last as in training and evaluation: same numbers up to rounding, and the
    # thousands of forward passes of the deletion / insertion curves run 30-40% faster on
    # CPU (oneDNN's depthwise convolutions) and use cuDNN's tensor-core kernels on GPU.
    model = model.to(dev, memory_format=torch.channels_last).eval()  # type: ignore[call-overload]  # torch's stubs lack Module.to(device, memory_format=...), which it accepts
    return RunContext(run_id, method, dataset, protocol, splits, model, dev, dict(tags))


# ------------------------------------------------------------------------ pairs


def near_miss_class_pairs(classes: dict[int, dict], parts: list[str]) -> list[tuple[int, int, int]]:
    """``(class a, class b, part label)`` for every two classes whose attributes differ in
    exactly one part (the label is the part's index + 1, as in the part masks)."""
    ids = sorted(classes)
    out = []
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            differ = [p for p in parts if classes[a][p] != classes[b][p]]
            if len(differ) == 1:
                out.append((a, b, parts.index(differ[0]) + 1))
    return out


@dataclass
class Pairs:
    query: np.ndarray  # P test indices
    gallery: np.ndarray  # P test indices
    same: np.ndarray  # P bools
    region: np.ndarray  # P part labels that differ (0: none known)
    kind: str


def _near_miss_pairs(ctx: RunContext, count: int, rng: np.random.Generator) -> Pairs | None:
    root = ctx.splits.extras.get("root")
    manifest = Path(root) / "manifest.json" if root else None
    if manifest is None or not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    labels = ctx.splits.test.labels
    present = set(np.unique(labels).tolist())
    classes = {c: spec for c, spec in enumerate(data.get("classes", [])) if c in present}
    candidates = near_miss_class_pairs(classes, list(data["parts"]))
    if not candidates:
        return None
    by_class = {c: np.flatnonzero(labels == c) for c in present}
    order = rng.permutation(len(candidates))
    q, g, region = [], [], []
    for k in range(count):
        a, b, part = candidates[order[k % len(candidates)]]
        if rng.random() < 0.5:
            a, b = b, a
        q.append(rng.choice(by_class[a]))
        g.append(rng.choice(by_class[b]))
        region.append(part)
    return Pairs(
        np.array(q), np.array(g), np.zeros(count, dtype=bool), np.array(region), "near-miss"
    )


def _neighbour_pairs(ctx: RunContext, count: int, rng: np.random.Generator, batch: int) -> Pairs:
    test = ctx.splits.test
    emb = torch.cat(
        [
            _forward(ctx, _images(ctx, np.arange(i, min(i + batch, len(test))))).embedding.float()
            for i in range(0, len(test), batch)
        ]
    )
    queries = rng.choice(len(test), size=count, replace=count > len(test))
    sims = emb[torch.as_tensor(queries)] @ emb.T
    sims[torch.arange(count), torch.as_tensor(queries)] = -float("inf")
    gallery = sims.argmax(1).numpy()
    same = test.labels[queries] == test.labels[gallery]
    return Pairs(queries, gallery, same, np.zeros(count, dtype=np.int64), "nearest-neighbour")


# ------------------------------------------------------------------------ images and maps


def _images(ctx: RunContext, indices: np.ndarray) -> torch.Tensor:
    from harness.components.data.transforms import build_transform, normalize_batch

    transform = build_transform(ctx.protocol.image, train=False)
    stack = torch.stack([transform(ctx.splits.test.read(int(i))) for i in indices])
    return normalize_batch(stack.to(ctx.device), ctx.protocol.image).contiguous(
        memory_format=torch.channels_last
    )


def _pictures(ctx: RunContext, images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(ctx.protocol.image.mean, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(ctx.protocol.image.std, device=images.device).view(1, 3, 1, 1)
    return (images * std + mean).clamp(0, 1).cpu()


def _part_labels(ctx: RunContext, indices: np.ndarray) -> torch.Tensor | None:
    """The part masks of test images, resized and cropped as the images are (nearest)."""
    masks = ctx.splits.extras.get("masks")
    if not masks:
        return None
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    from harness.components.data.synthetic import load_part_mask

    spec, keys = ctx.protocol.image, ctx.splits.test.keys()
    out = []
    for i in indices:
        mask = torch.from_numpy(
            load_part_mask(ctx.splits.extras["root"], masks[keys[int(i)]]).copy()
        )[None]
        out.append(
            TF.center_crop(
                TF.resize(mask, spec.resize, interpolation=InterpolationMode.NEAREST), spec.size
            )[0]
        )
    return torch.stack(out)


def _forward(ctx: RunContext, images: torch.Tensor):
    with torch.no_grad():
        return ctx.model(images)


def similarity_gradcam(
    model, query_images: torch.Tensor, gallery_images: torch.Tensor, same: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Grad-CAM of the pair's target score (cosine for a same-class pair, minus the cosine
    otherwise) on the last feature map the backbone hands to the head: alpha_k = spatial
    mean of dt/dA_k, map = ReLU(sum_k alpha_k A_k) (Selvaraju et al. 2017, Eqs. 1-2). Each
    image's map is taken with its partner's embedding held fixed (an image's map depends
    only on its own pair). Rows must not interact (eval mode).

    Returns the two P x h x w maps and the head's output for the 2P images (queries first,
    detached), so that the method's own maps need no second forward pass."""
    n = len(query_images)
    with torch.no_grad():
        maps = [m.detach() for m in model.backbone(torch.cat([query_images, gallery_images]))]
    with torch.enable_grad():
        last = maps[-1].float().requires_grad_()
        out = model.head([*maps[:-1], last.to(maps[-1].dtype)])
        e = out.embedding.float()
        cos = (e[:n] * e[n:]).sum(-1)
        target = torch.where(torch.as_tensor(same, device=cos.device), cos, -cos)
        (grad,) = torch.autograd.grad(target.sum(), last)
    cam = F.relu((grad.mean((2, 3), keepdim=True) * last.detach()).sum(1))
    return cam[:n], cam[n:], _detached(out)


def _detached(out):
    """A head output with every tensor (also in lists and ``extras``) detached."""
    return _map_tensors(out, lambda x: x.detach())


def output_rows(out, rows: slice):
    """The head output of the images ``rows`` (tensors, lists of tensors, ``extras``)."""
    return _map_tensors(out, lambda x: x[rows])


def _map_tensors(out, fn):
    """``out`` (a head output) with ``fn`` applied to every tensor, also inside lists,
    tuples and ``extras``."""

    def apply(value):
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, list | tuple):
            return type(value)(apply(v) for v in value)
        if isinstance(value, dict):
            return {k: apply(v) for k, v in value.items()}
        return value

    return type(out)(**{k: apply(v) for k, v in vars(out).items()})


def _to_image(maps: torch.Tensor, size: int) -> torch.Tensor:
    from harness.components.explanation.maps import upsample_maps

    return upsample_maps(maps.float()[:, None], (size, size), normalize=False)[:, 0].clamp_min(0)


@dataclass
class PairMaps:
    query: torch.Tensor  # P x H x W at image size
    gallery: torch.Tensor


def _maps(
    ctx: RunContext, pairs: Pairs, batch: int
) -> tuple[PairMaps | None, PairMaps, torch.Tensor, torch.Tensor]:
    """The method's own and the baseline's maps of every pair, at image size (CPU), and
    the query and gallery embeddings (P x D), all from one forward pass per batch."""
    size = ctx.protocol.image.size
    own_q, own_g, base_q, base_g, emb_q, emb_g = [], [], [], [], [], []
    has_own = True
    for start in range(0, len(pairs.query), batch):
        rows = slice(start, start + batch)
        q, g = _images(ctx, pairs.query[rows]), _images(ctx, pairs.gallery[rows])
        same = torch.as_tensor(pairs.same[rows], device=ctx.device)
        bq, bg, out = similarity_gradcam(ctx.model, q, g, same)
        base_q.append(_to_image(bq, size).cpu())
        base_g.append(_to_image(bg, size).cpu())
        emb_q.append(out.embedding[: len(q)].float())
        emb_g.append(out.embedding[len(q) :].float())
        if has_own:
            with torch.no_grad():
                own = ctx.model.head.pair_maps(
                    output_rows(out, slice(0, len(q))), output_rows(out, slice(len(q), None)), same
                )
            if own is None:
                has_own = False
            else:
                own_q.append(_to_image(own[0], size).cpu())
                own_g.append(_to_image(own[1], size).cpu())
    method = PairMaps(torch.cat(own_q), torch.cat(own_g)) if has_own else None
    return (
        method,
        PairMaps(torch.cat(base_q), torch.cat(base_g)),
        torch.cat(emb_q),
        torch.cat(emb_g),
    )


# ------------------------------------------------------------------------ scores


def _uniform_if_empty(maps: torch.Tensor) -> torch.Tensor:
    """Maps without mass (a Grad-CAM whose ReLU keeps nothing) read as uniform: no pixel is
    preferred, which is also how the deletion order treats them (ties broken at random)."""
    empty = maps.flatten(1).sum(1) <= 0
    return torch.where(empty[:, None, None], torch.ones_like(maps), maps)


def _empty_maps(sources: dict[str, PairMaps]) -> str:
    counts = {
        name: int((m.query.flatten(1).sum(1) <= 0).sum() + (m.gallery.flatten(1).sum(1) <= 0).sum())
        for name, m in sources.items()
    }
    return ", ".join(f"{name} {count}" for name, count in counts.items() if count)


def _ground_truth_scores(
    maps: PairMaps, labels_q: torch.Tensor, labels_g: torch.Tensor, pairs: Pairs, parts: list[str]
) -> dict[str, np.ndarray]:
    """Per pair: object share and per-part shares, and (near-miss pairs) the differing part's
    share, its area share and the pointing game; each the mean over the pair's two images."""
    out: dict[str, np.ndarray] = {}
    maps = PairMaps(_uniform_if_empty(maps.query), _uniform_if_empty(maps.gallery))
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
    return out


def _curves(
    ctx: RunContext,
    pairs: Pairs,
    order_maps: dict[str, torch.Tensor],
    gallery_emb: torch.Tensor,
    seed: int,
    batch: int,
) -> dict[str, dict[str, np.ndarray]]:
    """:func:`~harness.components.explanation.scores.perturbation_curves` of the pairs' query side for each
    pixel order in ``order_maps`` (name -> P x H x W): name -> {"fractions", "deletion",
    "insertion"} (P x S each)."""
    generator = torch.Generator().manual_seed(seed)
    queries = _images(ctx, pairs.query)
    same = torch.as_tensor(pairs.same)

    def embed(images):
        return ctx.model(images.contiguous(memory_format=torch.channels_last)).embedding

    from tqdm import tqdm

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
            )
            out[name] = {
                "fractions": fractions.numpy(),
                "deletion": deletion.numpy(),
                "insertion": insertion.numpy(),
            }
    return out


def _summary(per_pair: dict[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, values in per_pair.items():
        mean, lo, hi = mean_interval(values)
        out[key] = mean
        out[f"{key}_ci95"] = [lo, hi]
    return out


def _method_figures(ctx: RunContext, pairs: Pairs, out_dir: Path) -> list[Path]:
    """The method's own figures, in its paper's style: its per-image maps (A-grouping Figs.
    3-4 layout, :func:`~harness.components.explanation.maps.attention_figure`) and its pair figure (DIML Fig. 5,
    SAM Fig. 4) for the first pair."""
    from harness.components.explanation.maps import attention_figure
    from methods import HeadOutput

    written = []
    images = _images(ctx, pairs.query[:16])
    with torch.no_grad():
        out = ctx.model(images)
        maps = ctx.model.head.explain(images, out)
    pictures = _pictures(ctx, images)
    if maps is not None:
        rank = out.attention.amax(dim=(2, 3)).cpu() if out.attention is not None else "mass"
        title = f"{ctx.method}, run {ctx.run_id[:8]}: maps on {len(images)} query images"
        written.append(
            attention_figure(pictures, maps.cpu(), out_dir / "maps.png", rank_by=rank, title=title)
        )
    q, g = _images(ctx, pairs.query[:1]), _images(ctx, pairs.gallery[:1])
    with torch.no_grad():
        oq, og = ctx.model(q), ctx.model(g)

    # the pair figure gets outputs without extras (as log_explanations passes them)
    def bare(out):
        return HeadOutput(**{k: v for k, v in vars(out).items() if k != "extras"})

    pictures_pair = [_pictures(ctx, q)[0], _pictures(ctx, g)[0]]
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


def explain_run(
    ctx: RunContext,
    *,
    pairs: int = 200,
    curve_pairs: int = CURVE_PAIRS,
    seed: int = 0,
    out_dir: Path,
    batch: int = MAPS_BATCH,
    figures: bool = True,
) -> dict[str, Any]:
    """Everything ``explain`` computes for one rebuilt run; returns the JSON record.
    Maps and part scores cover all ``pairs``; the deletion / insertion curves the first
    ``curve_pairs`` of them (each costs 2 x 19 + 1 forward passes per pixel order)."""
    started = time.perf_counter()
    notes = []
    rng = np.random.default_rng(seed)
    chosen = _near_miss_pairs(ctx, pairs, rng)
    if chosen is None:
        chosen = _neighbour_pairs(ctx, pairs, rng, EMBED_BATCH)
    method_maps, baseline_maps, emb_q, emb_g = _maps(ctx, chosen, batch)
    if method_maps is None:
        notes.append(
            f"method '{ctx.method}' has no explanation maps of its own (no pair_maps): "
            f"only the Grad-CAM baseline is scored"
        )
    sources = (
        {"baseline": baseline_maps}
        if method_maps is None
        else {"method": method_maps, "baseline": baseline_maps}
    )
    per_pair: dict[str, dict[str, np.ndarray]] = {name: {} for name in sources}
    empty = _empty_maps(sources)
    if empty:
        notes.append(
            f"maps with no mass at all (scored as uniform), of {2 * len(chosen.query)} per source: {empty}"
        )
    notes += _score_parts(ctx, chosen, sources, per_pair)
    m = min(curve_pairs, len(chosen.query))  # the first m pairs (in random order already)
    curves = _score_curves(ctx, _first(chosen, m), sources, emb_g[:m], per_pair, seed)
    figures_written = _write_figures(ctx, chosen, sources, curves, out_dir) if figures else []
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
        "method": _summary(per_pair["method"]) if "method" in per_pair else None,
        "baseline": _summary(per_pair["baseline"]),
        "baseline_kind": "similarity Grad-CAM of the embedding (last feature map)",
        "notes": notes,
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
    labels_q, labels_g = _part_labels(ctx, chosen.query), _part_labels(ctx, chosen.gallery)
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
        per_pair[name].update(_ground_truth_scores(maps, labels_q, labels_g, chosen, parts))
    return notes


def _score_curves(
    ctx: RunContext,
    chosen: Pairs,
    sources: dict[str, PairMaps],
    emb_g,
    per_pair: dict[str, dict[str, np.ndarray]],
    seed: int,
) -> dict[str, Any]:
    """Deletion and insertion curves of ``chosen`` in each source's pixel order and in a
    random one; each source's areas under them (and the random order's) into ``per_pair``."""
    size = ctx.protocol.image.size
    m = len(chosen.query)
    orders = {name: maps.query[:m] for name, maps in sources.items()}
    orders["random"] = random_scores((m, size, size), torch.Generator().manual_seed(seed + 1))
    curves = _curves(ctx, chosen, orders, emb_g, seed, batch=PERTURB_BATCH)
    for name in sources:
        for kind in ("deletion", "insertion"):
            per_pair[name][f"{kind}_auc"] = curve_auc(
                torch.as_tensor(curves[name][kind]), torch.as_tensor(curves[name]["fractions"])
            ).numpy()
            per_pair[name][f"random_{kind}_auc"] = curve_auc(
                torch.as_tensor(curves["random"][kind]),
                torch.as_tensor(curves["random"]["fractions"]),
            ).numpy()
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
            _pictures(ctx, _images(ctx, chosen.query[:show])),
            _pictures(ctx, _images(ctx, chosen.gallery[:show])),
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
    ``explain/<source>_<score>`` metrics (``_lo`` / ``_hi``: the interval), the pair kind,
    seed and notes as tags, ``explain/scores.json`` and the figures under ``explain/``."""
    from harness.store.queries import log_to_run

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
    log_to_run(
        ctx.run_id,
        metrics={k: v for k, v in metrics.items() if v is not None and np.isfinite(v)},
        tags={
            "explain_pair_kind": record["pair_kind"],
            "explain_seed": str(record["seed"]),
            "explain_notes": "; ".join(record["notes"])[:5000] or "none",
        },
        texts={"explain/scores.json": json.dumps(finite_json(record), indent=2, allow_nan=False)},
        artifacts=[(Path(f), "explain") for f in record["figures"]],
    )
