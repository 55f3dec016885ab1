"""Scores of explanation maps against ground truth and against the model itself.

Pure functions over tensors, used by ``python -m harness explain`` (:mod:`harness.engine.explain.explain_run`)
and tested on planted maps (``tests/engine/test_explain.py``).

Ground truth (the ``synthetic`` dataset's part label maps: 0 background, 1..4 parts):

* :func:`part_shares`: the share of a map's mass on the background and on each part
  (purity = 1 - background share: the share inside the object);
* :func:`region_scores`: for one region per image (a near-miss pair's differing part),
  the share of the map's mass on it, its area share (what a uniform map scores: chance),
  and the pointing game (Zhang et al., "Top-down neural attention by excitation
  backprop", ECCV 2016: a hit when the map's maximum lies on the region);
* :func:`within_object_scores`: the same read inside the object only (the part's share of
  the map's mass on the object, against the part's share of the object's area, and the
  pointing game over the object's pixels). The share above rewards a map for finding the
  object at all (a map uniform over the whole creature scores the object's area over the
  part's, several times chance); this one asks which part of the object the map prefers,
  and a map uniform on the object scores its chance exactly.

Faithfulness (any dataset): :func:`perturbation_masks` and :func:`curve_auc` build the
deletion and insertion curves of Petsiuk et al. ("RISE", BMVC 2018, Sec. 4.1) for a
similarity instead of a class probability: pixels are removed (or revealed) most-attributed
first, in steps of ``step`` of the image, and the area under the curve of the pair's
score, mapped to [0, 1], summarises it (deletion: lower is better; insertion: higher).
A random pixel order (:func:`random_scores`) is the reference every map must beat.

:func:`mean_interval` gives the mean and 95% t-interval of a per-pair score.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import stats

from harness.components.explanation.curve_settings import CANVASES

__all__ = [
    "part_shares",
    "region_scores",
    "within_object_scores",
    "pixel_order_masks",
    "perturbation_masks",
    "random_scores",
    "perturbation_curves",
    "curve_auc",
    "mean_interval",
    "STEP",
    "gaussian_kernel",
    "blurred_canvas",
]

#: Fraction of the image removed or revealed per step of the deletion / insertion curves.
STEP = 0.05

BLUR_SIGMA = 5 / 224


def gaussian_kernel(sigma: float) -> torch.Tensor:
    """A 1-D Gaussian of standard deviation ``sigma`` pixels over +-3 sigma (at least
    +-1), summing to one (float64)."""
    radius = max(1, int(math.ceil(3 * sigma)))
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-0.5 * (x / sigma) ** 2)
    return kernel / kernel.sum()


def blurred_canvas(images: torch.Tensor, sigma: float = BLUR_SIGMA) -> torch.Tensor:
    """``images`` (N x 3 x H x W) blurred by a Gaussian of ``sigma`` x H pixels (a
    separable kernel of +-3 sigma, reflected at the borders): the insertion curve's canvas
    that keeps each region's colour but not its shape or texture."""
    kernel = gaussian_kernel(max(sigma * images.shape[-1], 1e-3))
    kernel = kernel.to(images.dtype).to(images.device)
    radius = len(kernel) // 2
    c = images.shape[1]
    out = torch.nn.functional.pad(images, (radius, radius, radius, radius), mode="reflect")
    out = torch.nn.functional.conv2d(out, kernel.view(1, 1, 1, -1).repeat(c, 1, 1, 1), groups=c)
    return torch.nn.functional.conv2d(out, kernel.view(1, 1, -1, 1).repeat(c, 1, 1, 1), groups=c)


def _check_maps(maps: torch.Tensor, labels: torch.Tensor) -> None:
    if maps.dim() != 3 or labels.shape != maps.shape:
        raise ValueError(
            f"maps and labels must both be N x H x W, got {tuple(maps.shape)} and {tuple(labels.shape)}"
        )
    if (maps < 0).any():
        raise ValueError("maps must be non-negative")


def part_shares(maps: torch.Tensor, labels: torch.Tensor, num_parts: int) -> torch.Tensor:
    """Share of each map's mass on the background (column 0) and on parts 1..``num_parts``:
    N x (parts + 1), rows summing to one (a map with no mass: NaN). ``maps``: N x H x W,
    non-negative; ``labels``: N x H x W integers at the same resolution."""
    _check_maps(maps, labels)
    maps = maps.double()
    onehot = torch.nn.functional.one_hot(
        labels.long(), num_parts + 1
    ).double()  # N x H x W x (K + 1)
    mass = torch.einsum("nhw,nhwk->nk", maps, onehot)
    total = maps.sum((1, 2))[:, None]
    return torch.where(total > 0, mass / total.clamp_min(1e-300), torch.full_like(mass, math.nan))


def region_scores(
    maps: torch.Tensor, labels: torch.Tensor, region: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per image (N), for the region ``labels == region[i]`` (e.g. a near-miss pair's
    differing part): ``share`` of the map's mass on it, ``chance`` = its share of the
    image's area (what a uniform map scores), and ``pointing`` = 1.0 when the map's
    maximum lies on it (ties: every maximal pixel must lie on it, so a flat map only
    scores a hit when the region is the whole image), else 0.0. A map without mass scores
    share NaN."""
    _check_maps(maps, labels)
    inside = labels.long() == region.long().view(-1, 1, 1)
    maps = maps.double()
    total = maps.sum((1, 2))
    share = torch.where(
        total > 0,
        (maps * inside).sum((1, 2)) / total.clamp_min(1e-300),
        torch.full_like(total, math.nan),
    )
    chance = inside.double().mean((1, 2))
    peak = maps == maps.amax((1, 2), keepdim=True)
    pointing = (peak & ~inside).flatten(1).any(1).logical_not().double()
    return {"share": share, "chance": chance, "pointing": pointing}


def within_object_scores(
    maps: torch.Tensor, labels: torch.Tensor, region: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per image (N), the region ``labels == region[i]`` read inside the object (``labels >
    0``): ``share`` = the map's mass on the region / its mass on the object, ``chance`` =
    the region's area / the object's area (what a map uniform on the object scores), and
    ``pointing`` = 1.0 when the map's maximum over the object's pixels lies on the region
    (every maximal object pixel, as :func:`region_scores`). A map with no mass on the
    object prefers no part of it: it scores the chance and no pointing hit."""
    _check_maps(maps, labels)
    inside = labels.long() == region.long().view(-1, 1, 1)
    obj = labels.long() > 0
    maps = maps.double()
    on_object = (maps * obj).sum((1, 2))
    chance = inside.double().sum((1, 2)) / obj.double().sum((1, 2)).clamp_min(1)
    share = torch.where(
        on_object > 0, (maps * inside).sum((1, 2)) / on_object.clamp_min(1e-300), chance
    )
    masked = torch.where(obj, maps, torch.full_like(maps, -math.inf))
    peak = obj & (masked == masked.amax((1, 2), keepdim=True))
    pointing = (peak & ~inside).flatten(1).any(1).logical_not() & (on_object > 0)
    return {"share": share, "chance": chance, "pointing": pointing.double()}


def pixel_order_masks(scores: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """N x H x W pixel scores -> N x S x H x W booleans: step s marks the
    ``round(fractions[s] * H * W)`` highest-scoring pixels of each image. Ties are broken
    by the scores' order as given (add a small random jitter beforehand to break them at
    random)."""
    n, h, w = scores.shape
    flat = scores.reshape(n, -1)
    rank = torch.empty_like(flat, dtype=torch.long)
    order = flat.argsort(dim=1, descending=True, stable=True)
    rank.scatter_(1, order, torch.arange(h * w, device=scores.device).expand(n, -1))
    counts = torch.round(fractions.double() * h * w).long().to(scores.device)
    return (rank[:, None, :] < counts[None, :, None]).view(n, len(fractions), h, w)


def perturbation_masks(
    maps: torch.Tensor,
    *,
    step: float = STEP,
    generator: torch.Generator | None = None,
    jitter: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The steps of the deletion / insertion curves of N maps: (fractions S, masks N x S x H x W),
    fractions 0, step, ..., 1; mask s covers the most-attributed ``fractions[s]`` of the pixels.
    Ties (flat regions, the zeros of a ReLU) are broken at random by a jitter of ``jitter``
    times the map's range drawn from ``generator``."""
    steps = int(round(1 / step))
    fractions = torch.linspace(0, 1, steps + 1, dtype=torch.float64)
    maps = maps.double()
    span = (maps.amax((1, 2), keepdim=True) - maps.amin((1, 2), keepdim=True)).clamp_min(1e-12)
    noise = torch.rand(maps.shape, generator=generator, dtype=torch.float64).to(maps.device)
    return fractions, pixel_order_masks(maps + jitter * span * noise, fractions)


def random_scores(shape: tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
    """A random pixel order as a map (N x H x W uniform scores): the reference curves."""
    return torch.rand(shape, generator=generator, dtype=torch.float64)


@torch.inference_mode()
def perturbation_curves(
    embed,
    queries: torch.Tensor,
    gallery_embeddings: torch.Tensor,
    same: torch.Tensor,
    scores: torch.Tensor,
    *,
    step: float = STEP,
    generator: torch.Generator | None = None,
    batch: int = 256,
    on_chunk=None,
    canvas: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deletion and insertion curves of P pairs' target scores (RISE Sec. 4.1, for a similarity).

    ``embed``: images -> unit embeddings (N x D); ``queries``: P x 3 x H x W normalised
    images, perturbed; ``gallery_embeddings``: P x D, the partners, intact; ``same``: P
    bools, the target being t = cos for a same-class pair and -cos otherwise; ``scores``:
    P x H x W, the pixel order (most-attributed first). Deletion sets the first k pixels of
    the query to 0 (the normalised input's mean colour); insertion shows only them, on the
    ``canvas`` (:data:`CANVASES`: that same 0, or the query blurred). Returns
    (fractions S, deletion P x S, insertion P x S) with values (1 + t) / 2 in [0, 1]; the
    images go through ``embed`` ``batch`` at a time; ``on_chunk(pairs_done)`` is called
    after every few pairs (a progress bar's ``update``)."""
    n, device = len(queries), queries.device
    sign = torch.where(torch.as_tensor(same, device=device), 1.0, -1.0)
    gallery = gallery_embeddings.float().to(device)
    steps = int(round(1 / step)) + 1
    deletion = torch.empty(n, steps, dtype=torch.float64)
    insertion = torch.empty(n, steps, dtype=torch.float64)
    fractions = torch.linspace(0, 1, steps, dtype=torch.float64)
    if n == 0:
        return fractions, deletion, insertion
    if canvas not in CANVASES:
        raise ValueError(f"unknown insertion canvas {canvas!r}: expected one of {CANVASES}")
    # The curves' ends are the same images for every pixel order: deletion at 0 and
    # insertion at 1 are the intact query, deletion at 1 the blank image (one for all
    # pairs), insertion at 0 the canvas. Only the inner steps go through the model per order.
    blank = embed(torch.zeros_like(queries[:1])).float()  # 1 x D
    per_chunk = 6  # pairs whose masks are built at once (memory: 6 x 39 images)
    for start in range(0, n, per_chunk):
        rows = slice(start, min(n, start + per_chunk))
        fractions, masks = perturbation_masks(scores[rows], step=step, generator=generator)
        keep = masks[:, 1:-1].to(device)[:, :, None]  # p x inner x 1 x H x W
        under = blurred_canvas(queries[rows]) if canvas == "blur" else None
        t_moved, t_intact = _perturbed_targets(
            embed, queries[rows], keep, gallery[rows], sign[rows], batch, under
        )
        t_blank = (blank * gallery[rows]).sum(-1) * sign[rows]
        t_start = t_blank
        if under is not None:
            t_start = (embed(under).float() * gallery[rows]).sum(-1) * sign[rows]
        deletion[rows] = _curve(t_intact, t_moved[0], t_blank)
        insertion[rows] = _curve(t_start, t_moved[1], t_intact)
        if on_chunk is not None:
            on_chunk(len(t_intact))
    return fractions, deletion, insertion


def _perturbed_targets(
    embed,
    q: torch.Tensor,
    keep: torch.Tensor,
    gallery: torch.Tensor,
    sign: torch.Tensor,
    batch: int,
    canvas: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets t of p queries (p x 3 x H x W) against their partners (p x D): with
    their pixels deleted and inserted at each inner step (``keep``: p x inner x 1 x H x W
    masks; inserted on ``canvas``, p x 3 x H x W, else on 0), 2 x p x inner, and intact, p;
    the images go through ``embed`` ``batch`` at a time."""
    inserted = q[:, None] * keep
    if canvas is not None:
        inserted = inserted + canvas[:, None] * ~keep
    images = torch.cat([(q[:, None] * ~keep).flatten(0, 1), inserted.flatten(0, 1), q])
    emb = torch.cat([embed(images[i : i + batch]).float() for i in range(0, len(images), batch)])
    p, inner = keep.shape[:2]
    intact = emb[2 * p * inner :]  # p x D
    moved = emb[: 2 * p * inner].view(2, p, inner, -1)  # deletion, then insertion
    t_moved = (moved * gallery[None, :, None]).sum(-1) * sign[None, :, None]
    t_intact = (intact * gallery).sum(-1) * sign
    return t_moved, t_intact


def _curve(first: torch.Tensor, inner: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """One curve per pair, (1 + t) / 2 from its first point through its inner steps to its
    last (p x S, float64 on the host)."""
    return ((1 + torch.cat([first[:, None], inner, last[:, None]], 1)) / 2).double().cpu()


def curve_auc(values: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """Area under curves (... x S) over ``fractions`` (S, from 0 to 1) by the trapezoidal
    rule. Values in [0, 1] give an area in [0, 1]."""
    return torch.trapezoid(values.double(), fractions.double().to(values.device), dim=-1)


def mean_interval(
    values, confidence: float = 0.95, bounds: tuple[float, float] = (0.0, 1.0)
) -> tuple[float, float, float]:
    """Mean and two-sided ``confidence`` t-interval of the finite ``values`` (NaN when none;
    the interval collapses to the mean for a single value), clipped to ``bounds`` (every
    score here lies in [0, 1]; a t-interval over few pairs can reach past it)."""

    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size == 1:
        return mean, mean, mean
    half = float(stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, max(bounds[0], mean - half), min(bounds[1], mean + half)
