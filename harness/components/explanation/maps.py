"""Explanation maps: resizing to the image, figures, and part statistics.

Generic over plugins: anything that yields B x K x h x w spatial maps (A-grouping's
attention, a gate's masks, a similarity map) can use these.

* :func:`upsample_maps`: maps at feature resolution -> image resolution, each map
  min-max normalised to [0, 1] (A-grouping Eq. 9-10 plus the normalisation every
  heat-map figure needs).
* :func:`offset_removed`: a map as it is scored and drawn: its negative values cut and
  its constant offset (its minimum) taken away, so that a share of its mass measures
  where it rises and not how high it stands everywhere; a figure's min-max scaling of
  such a map is the map itself up to scale.
* :func:`attention_figure`: one row per map channel (group), the ``top`` images where
  that channel is strongest, map overlaid (A-grouping Figs. 3-4); written as a PNG.
* :func:`part_attention_mass`: the share of each channel's mass on the background
  and on each annotated part (a number for "group 2 looks at the head").
* :func:`grouped_pair_maps`: one map per image of a (query, gallery) pair from the
  per-group maps of a head whose similarity is the mean of per-group cosines.

Matplotlib is driven through its Agg canvas directly (no ``pyplot``), so calling
these never changes the process's global backend or leaks open figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "upsample_maps",
    "minmax_normalize",
    "offset_removed",
    "attention_figure",
    "part_attention_mass",
    "grouped_pair_maps",
]

RANKINGS = ("max", "mass", "concentration")


def minmax_normalize(maps: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Each H x W map of a B x K x H x W tensor rescaled to [0, 1]; a constant map becomes 0."""
    lo = maps.amin(dim=(-2, -1), keepdim=True)
    hi = maps.amax(dim=(-2, -1), keepdim=True)
    return (maps - lo) / (hi - lo).clamp_min(eps)


def offset_removed(maps: torch.Tensor) -> torch.Tensor:
    """Each H x W map of a ... x H x W tensor non-negative (values below 0 cut) with its
    minimum subtracted: a map that stands at c everywhere and rises by m on a region is
    read as m on the region. Its mass then measures where the map rises, and
    :func:`minmax_normalize` of it (what a figure draws) is the same map divided by its
    maximum."""
    rectified = maps.clamp_min(0)
    return rectified - rectified.amin(dim=(-2, -1), keepdim=True)


def upsample_maps(
    maps: torch.Tensor, size: Sequence[int], *, normalize: bool = True
) -> torch.Tensor:
    """B x K x h x w -> B x K x H x W by bilinear interpolation (A-grouping Eq. 10),
    then min-max normalised per map unless ``normalize`` is False."""
    if maps.dim() != 4:
        raise ValueError(f"maps must be B x K x h x w, got shape {tuple(maps.shape)}")
    out = F.interpolate(
        maps.detach().float(),
        size=tuple(int(s) for s in size),
        mode="bilinear",
        align_corners=False,
    )
    return minmax_normalize(out) if normalize else out


def grouped_pair_maps(
    query_maps: torch.Tensor,
    gallery_maps: torch.Tensor,
    query_groups: torch.Tensor,
    gallery_groups: torch.Tensor,
    same: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair maps of a grouped head (A-grouping, G-grouping, DIABLO): the cosine of two
    embeddings is the mean of their P per-group cosines c_p (each group unit-norm), so each
    image's map is its P group maps (P x B x K x h x w -> B x h x w) weighted by the group's
    share of the pair's similarity, 1 + c_p, for a same-class pair, or of its distance,
    ``||g_p - g'_p||^2 / 2 = 1 - c_p``, for a pair of two classes (both non-negative).

    ``*_maps``: B x P x h x w non-negative (attention, gates); ``*_groups``: B x P x d unit
    vectors; ``same``: B bools. A harness choice: the papers draw the group maps one by one."""
    cos = (query_groups.float() * gallery_groups.float()).sum(-1)  # B x P
    sign = torch.where(torch.as_tensor(same, device=cos.device)[:, None], 1.0, -1.0)
    weight = (1 + sign * cos).clamp_min(0)[..., None, None]
    return (
        (weight * query_maps.float().clamp_min(0)).sum(1),
        (weight * gallery_maps.float().clamp_min(0)).sum(1),
    )


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)


def _scores(maps: np.ndarray, rank_by) -> np.ndarray:
    """B x K scores used to choose each channel's top images."""
    if not isinstance(rank_by, str):
        scores = _numpy(rank_by).astype(np.float64)
        if scores.shape != maps.shape[:2]:
            raise ValueError(f"rank_by scores must be B x K = {maps.shape[:2]}, got {scores.shape}")
        return scores
    if rank_by == "max":
        return maps.max(axis=(2, 3))
    if rank_by == "mass":
        return maps.mean(axis=(2, 3))
    if rank_by == "concentration":
        return maps.max(axis=(2, 3)) / np.maximum(maps.mean(axis=(2, 3)), 1e-12)
    raise ValueError(f"rank_by must be one of {RANKINGS} or a B x K array, got {rank_by!r}")


def attention_figure(
    images,
    maps,
    path,
    top: int = 4,
    *,
    rank_by="mass",
    alpha: float = 0.5,
    cmap: str = "jet",
    titles: Sequence[str] | None = None,
    dpi: int = 100,
    title: str = "",
) -> Path:
    """Write a PNG in the style of A-grouping Figs. 3-4: one row per group, its ``top``
    images (columns) with the group's map overlaid, under ``title`` (which run and
    images), with the columns' ranking named and a colour scale for the maps.

    ``images``: B x 3 x H x W in [0, 1] (already de-normalised); ``maps``: B x K x H x W
    in [0, 1] at image resolution (e.g. ``method.explain(images, output)``).
    ``rank_by`` chooses each row's images, strongest first: ``"max"`` (peak value),
    ``"mass"`` (mean value, i.e. total attention) or ``"concentration"`` (peak / mean),
    or an explicit B x K array of scores. Maps that are min-max normalised per image
    (what ``explain`` returns) all peak at 1, so ``"max"`` ties on them: rank those by
    ``"mass"``/``"concentration"`` or pass the head's raw scores, e.g.
    ``output.attention.amax(dim=(2, 3))``. Returns the path written.
    """
    # deferred: matplotlib adds 0.3 s to --help and methods (the plugins import this module)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    pictures, mp = _checked_figure_inputs(images, maps, top)
    batch, groups = mp.shape[:2]
    cols = min(top, batch)
    order = np.argsort(-_scores(mp, rank_by), axis=0, kind="stable")[:cols]  # cols x K

    # At least 3 inches wide, so that the labels stay legible in the MLflow UI's preview.
    fig = Figure(
        figsize=(max(2.0 * cols, 3.0) + 0.9, 2.0 * groups + 0.9), dpi=dpi, layout="constrained"
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(groups, cols, squeeze=False)
    overlay = _draw_rows(axes, pictures, mp, order, cmap=cmap, alpha=alpha, titles=titles)
    ranking = rank_by if isinstance(rank_by, str) else "score"
    fig.supxlabel(
        f"each row's {cols} images with the highest map {ranking}, strongest first", fontsize=10
    )
    if title:
        fig.suptitle(title, fontsize=11)
    # The scale drawn opaque (the overlays are blended at ``alpha`` over the images).
    scale = ScalarMappable(norm=Normalize(0.0, 1.0), cmap=overlay.get_cmap())
    colorbar = fig.colorbar(scale, ax=axes, shrink=0.8, fraction=0.05)
    colorbar.set_label(
        "map value (1 = the image's peak)" if rank_by != "max" else "map value", fontsize=10
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _checked_figure_inputs(images, maps, top: int) -> tuple[np.ndarray, np.ndarray]:
    """The images (B x 3 x H x W, or one channel) as pictures to draw (B x H x W x 3 in
    [0, 1]) and the maps (B x K x H x W) as a numpy array, their shapes checked."""
    imgs, mp = _numpy(images), _numpy(maps)
    if imgs.ndim != 4 or imgs.shape[1] not in (1, 3):
        raise ValueError(f"images must be B x 3 x H x W, got shape {imgs.shape}")
    if mp.ndim != 4 or mp.shape[0] != imgs.shape[0] or mp.shape[2:] != imgs.shape[2:]:
        raise ValueError(f"maps must be B x K x H x W matching images {imgs.shape}, got {mp.shape}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    pictures = np.clip(imgs.transpose(0, 2, 3, 1), 0.0, 1.0)
    if pictures.shape[-1] == 1:
        pictures = np.repeat(pictures, 3, axis=-1)
    return pictures, mp


def _draw_rows(
    axes,
    pictures: np.ndarray,
    maps: np.ndarray,
    order: np.ndarray,
    *,
    cmap: str,
    alpha: float,
    titles: Sequence[str] | None,
):
    """Each group's row: its images in ``order`` (cols x K) with the group's map overlaid,
    the row named, the columns numbered; returns the last overlay (for the colour scale)."""
    groups, cols = axes.shape
    overlay = None
    for g in range(groups):
        for c in range(cols):
            ax = axes[g, c]
            i = int(order[c, g])
            ax.imshow(pictures[i])
            overlay = ax.imshow(maps[i, g], cmap=cmap, alpha=alpha, vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(titles[g] if titles is not None else f"group {g + 1}", fontsize=11)
            if g == groups - 1:
                ax.set_xlabel(f"#{c + 1}", fontsize=10)
    assert overlay is not None  # the grid has at least one cell
    return overlay


def part_attention_mass(maps, part_labels, num_parts: int | None = None) -> np.ndarray:
    """Share of each channel's mass on the background and on each part: K x (parts + 1).

    ``maps``: B x K x H x W, non-negative; ``part_labels``: B x H x W integers, 0 =
    background, 1..parts = parts, at the same H x W as ``maps`` (resize one of them
    first). Masses are pooled over the batch (the sum over all images and pixels with
    a label, divided by the channel's total), so each row sums to one; a channel with
    no mass at all gives a row of NaN. ``num_parts`` defaults to the largest label.
    """
    mp = _numpy(maps).astype(np.float64)
    labels = _numpy(part_labels).astype(np.int64)
    if mp.ndim != 4:
        raise ValueError(f"maps must be B x K x H x W, got shape {mp.shape}")
    if labels.shape != (mp.shape[0],) + mp.shape[2:]:
        expected = (mp.shape[0],) + mp.shape[2:]
        raise ValueError(f"part_labels must be B x H x W = {expected}, got {labels.shape}")
    if (mp < 0).any():
        raise ValueError("maps must be non-negative")
    if labels.size and labels.min() < 0:
        raise ValueError("part labels must be >= 0 (0 = background)")
    parts = int(labels.max()) if num_parts is None else int(num_parts)
    if labels.size and labels.max() > parts:
        raise ValueError(f"part label {int(labels.max())} exceeds num_parts={parts}")
    flat = labels.ravel()
    mass = np.stack(
        [
            np.bincount(flat, weights=mp[:, k].ravel(), minlength=parts + 1)
            for k in range(mp.shape[1])
        ]
    )  # K x (parts + 1)
    total = mass.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, mass / total, np.nan)
