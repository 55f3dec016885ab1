"""The explanation figures and part statistics logged with a trained run.

For heads that explain (the roles :class:`harness.methods.roles.Explainer` and
:class:`harness.methods.roles.FigureMaker`), the engine calls :func:`log_explanations` after
the test evaluation. Plugins return data; this module draws it: every picture with a
map over it goes through :func:`draw_overlay`, every figure a plugin describes
(:class:`harness.methods.base.FigureData`) through :func:`draw_figure`, and
:func:`write_figure_set` writes a figure set's figures and data files.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch

from harness.base.atomic import atomic_write
from harness.base.metric_keys import metric_key
from harness.base.written import write_output_json, write_output_with
from harness.components.explanation.images import (
    ImageBatch,
    first_test_triplet,
    nearest_neighbour,
    part_shares,
    run_test_images,
)
from harness.components.explanation.maps import attention_figure, upsample_maps
from harness.methods.base import FigureData, FigureSet, HeadOutput, Link, Method
from harness.methods.roles import Explainer, FigureMaker

__all__ = [
    "log_explanations",
    "NO_MAPS_ARTIFACT",
    "no_maps_note",
    "draw_overlay",
    "overlay_heat",
    "heat_scale",
    "draw_figure",
    "write_figure_set",
    "write_tuple_figures",
    "pairs_figure",
    "strip_figure",
    "curves_figure",
]

#: Colour map and opacity of every map drawn over a picture.
HEAT_CMAP, HEAT_ALPHA = "jet", 0.5
#: The colour scale of the maps ``explain`` scores: offset removed, so min-max scaling
#: divides by the peak (:func:`overlay_heat`).
SCORED_SCALE = "map / its peak, as scored"


def _save_npz(fh, *, named: dict[str, np.ndarray]) -> None:
    np.savez(fh, **named)  # type: ignore[arg-type]  # numpy's stub reads ** as its allow_pickle


def picture_array(image) -> np.ndarray:
    """A picture to draw: 3 x H x W (or 1 x H x W) tensor in [0, 1] -> H x W x 3 array."""
    x = (
        image.detach().float().cpu()
        if isinstance(image, torch.Tensor)
        else torch.as_tensor(image).float()
    )
    if x.dim() == 3 and x.shape[0] in (1, 3):
        x = x.permute(1, 2, 0)
    if x.shape[-1] == 1:
        x = x.expand(*x.shape[:2], 3)
    return x.clamp(0, 1).numpy()


def draw_overlay(
    ax,
    image,
    heat: torch.Tensor | None = None,
    title: str = "",
    *,
    fontsize: int = 9,
    frame: bool = False,
) -> None:
    """``image`` (3 x H x W in [0, 1]) on ``ax`` with ``heat`` (h x w, any range) over it:
    resized to the image bilinearly, min-max scaled to [0, 1]
    (:func:`~harness.components.explanation.maps.upsample_maps`). ``frame``: keep the axes'
    frame (for a row label) instead of hiding the axes."""
    picture = picture_array(image)
    ax.imshow(picture)
    if heat is not None:
        up = overlay_heat(heat, picture.shape[:2])
        ax.imshow(up.numpy(), cmap=HEAT_CMAP, alpha=HEAT_ALPHA, vmin=0.0, vmax=1.0)
    if title:
        ax.set_title(title, fontsize=fontsize)
    if frame:
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        ax.axis("off")


def overlay_heat(heat: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """What :func:`draw_overlay` draws of ``heat`` (h x w) over a picture of ``size``:
    resized bilinearly and min-max scaled to [0, 1]. For a map of ``explain`` (non-negative,
    its minimum 0: :func:`~harness.components.explanation.maps.offset_removed`) this is the
    scored map divided by its maximum, so the figure and the scores read one map."""
    return upsample_maps(heat.detach().float().cpu()[None, None], tuple(size))[0, 0]


def _panel_point(axes, point: tuple[int, int, float, float]):
    """A :class:`~harness.methods.base.Link` end: (axes, (x, y) in the panel's pixel coordinates)."""
    row, col, fx, fy = point
    ax = axes[row, col]
    height, width = ax.images[0].get_array().shape[:2]
    return ax, (fx * width - 0.5, fy * height - 0.5)


def heat_scale(fig, axes, label: str = "heat (min-max scaled per image)") -> None:
    """The colour scale of :func:`draw_overlay`'s heat maps beside ``axes``, drawn opaque
    (the maps themselves are blended over the images)."""

    scale = fig.colorbar(
        ScalarMappable(norm=Normalize(0.0, 1.0), cmap=HEAT_CMAP), ax=axes, shrink=0.8, fraction=0.04
    )
    scale.set_label(label, fontsize=8)
    scale.ax.tick_params(labelsize=7)


def _write_npz(path: Path, named: dict[str, np.ndarray]) -> None:
    atomic_write(path, functools.partial(_save_npz, named=named))


def _save_png(fig: Any, path: Path) -> Path:
    """``fig`` as a PNG output at ``path``, written whole and recorded as the harness's."""
    return write_output_with(
        path, lambda p: atomic_write(p, lambda fh: fig.savefig(fh, format="png"))
    )


def draw_figure(figure: FigureData, path: Path, *, caption: str = "") -> Path:
    """Draw a plugin's :class:`~harness.methods.base.FigureData` to a PNG at ``path``: its panels
    (:func:`draw_overlay`), the G x G grid over each, its links as arrows labelled at
    their end, a colour scale when a panel has a heat map, and its title after
    ``caption`` (which run and images). Drawn on an Agg canvas (no pyplot, no global
    backend change)."""

    rows, cols = len(figure.panels), max(len(r) for r in figure.panels)
    size = 3.0 if cols <= 3 else 1.7  # inches per panel: a pair or triplet large, node rows small
    fig = Figure(figsize=(size * cols + 0.8, size * rows + 0.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    _draw_panels(axes, figure, cols, fontsize=9 if size >= 3 else 7)
    for link in figure.links:
        _draw_link(fig, axes, link)
    if any(panel.heat is not None for row in figure.panels for panel in row):
        heat_scale(fig, axes)
    title = ": ".join(t for t in (caption, figure.title) if t)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save_png(fig, path)


def _draw_panels(axes, figure: FigureData, cols: int, *, fontsize: int) -> None:
    """Each panel of ``figure`` on its axes (:func:`draw_overlay`) with the G x G grid over
    it; the axes a shorter row leaves empty are turned off."""
    for r, row in enumerate(figure.panels):
        for c in range(cols):
            if c >= len(row):
                axes[r, c].axis("off")
                continue
            panel = row[c]
            draw_overlay(axes[r, c], panel.image, panel.heat, panel.title, fontsize=fontsize)
            if figure.grid > 1:
                h, w = panel.image.shape[-2:]
                for t in range(1, figure.grid):
                    axes[r, c].axhline(t * h / figure.grid - 0.5, color="white", lw=0.4, alpha=0.6)
                    axes[r, c].axvline(t * w / figure.grid - 0.5, color="white", lw=0.4, alpha=0.6)


def _draw_link(fig, axes, link: Link) -> None:
    """One link of a figure: an arrow between its two panel points, a dot on each, and its
    label at its end."""

    (ax_a, xy_a), (ax_b, xy_b) = _panel_point(axes, link.start), _panel_point(axes, link.end)
    fig.add_artist(
        ConnectionPatch(
            xyA=xy_a,
            coordsA=ax_a.transData,
            xyB=xy_b,
            coordsB=ax_b.transData,
            color=link.colour,
            lw=1.8,
            arrowstyle="-|>",
            mutation_scale=12,
        )
    )
    for ax, xy in ((ax_a, xy_a), (ax_b, xy_b)):
        ax.plot(*xy, "o", color=link.colour, ms=5)
    if link.label:
        ax_b.annotate(
            link.label,
            xy=xy_b,
            xytext=(4, -4),
            textcoords="offset points",
            color=link.colour,
            fontsize=8,
            fontweight="bold",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "alpha": 0.7, "lw": 0},
        )


def write_figure_set(
    figures: FigureSet, out_dir: Path, stem: str, *, caption: str = ""
) -> list[Path]:
    """Write a plugin's :class:`~harness.methods.base.FigureSet` into ``out_dir``: each figure to
    ``<stem><suffix>.png`` (titled after ``caption``), each record to ``<stem><suffix>.json``,
    each set of arrays to ``<stem><suffix>.npz`` (atomically). Returns the files written,
    figures first."""
    written = [
        draw_figure(f, out_dir / f"{stem}{f.suffix}.png", caption=caption) for f in figures.figures
    ]
    for suffix, record in figures.records.items():
        path = out_dir / f"{stem}{suffix}.json"
        write_output_json(path, record)
        written.append(path)
    for suffix, arrays in figures.arrays.items():
        path = out_dir / f"{stem}{suffix}.npz"
        named = {k: v.detach().cpu().numpy() for k, v in arrays.items()}
        write_output_with(path, functools.partial(_write_npz, named=named))
        written.append(path)
    return written


def write_tuple_figures(
    head: Method,
    kind: str,
    images: list[torch.Tensor],
    outputs: list[HeadOutput],
    out_dir: Path,
    *,
    caption: str = "",
) -> list[Path]:
    """Ask ``head`` for its ``kind`` figure of a tuple of test images
    (:meth:`~harness.methods.roles.FigureMaker.figures`) and write what it returns, titled
    after ``caption``; [] when it draws none (or is no :class:`~harness.methods.roles.FigureMaker`)."""
    if not isinstance(head, FigureMaker) or kind not in head.figure_tuples:
        return []
    figures = head.figures(kind, images, outputs)
    return [] if figures is None else write_figure_set(figures, out_dir, kind, caption=caption)


def log_explanations(
    model,
    splits,
    protocol,
    device: torch.device,
    out_dir: Path,
    tracker,
    count: int = 48,
    *,
    run_label: str = "",
) -> None:
    """For heads that explain: a figure of their maps on test images (titled with
    ``run_label``, e.g. method, dataset and seed), the pair and triplet figures the head
    draws, and, where the dataset has part masks (``synthetic``), the share of each map's
    mass on each part.

    Mass uses the head's raw spatial attention when it has one (``output.attention``,
    upsampled without re-normalisation), else the explanation maps.
    """
    model.eval()
    n = min(count, len(splits.test))
    batch = run_test_images(model, splits.test, protocol.image, range(n), device)
    label = run_label or model.head.registry_name
    _log_pair_figure(model.head, batch, out_dir, tracker, label)
    _log_triplet_figure(model, splits, protocol, device, out_dir, tracker, label)
    maps = (
        model.head.explain(batch.images, batch.output)
        if isinstance(model.head, Explainer)
        else None
    )
    if maps is None:
        tracker.log_text(no_maps_note(model.head.registry_name), NO_MAPS_ARTIFACT)
        return
    _log_maps_figure(batch, maps, out_dir, tracker, f"{label}: maps on the first {n} test images")
    raw = batch.output.attention if batch.output.attention is not None else maps
    shares = part_shares(splits, protocol.image, raw, n)
    if shares is not None:
        _log_part_mass(
            shares, ["background", *splits.extras["parts"]], tracker, model.head.registry_name
        )


#: The artifact that says why a run has no maps of its own, and where its baseline's are.
NO_MAPS_ARTIFACT = "explanations/README.md"


def no_maps_note(method: str) -> str:
    """Why a run of ``method`` (a head without explanation maps) logs no maps, and where
    the maps of its similarity Grad-CAM baseline come from."""
    return (
        f"# No maps of its own\n\n{method} computes no explanation maps: its head gives the "
        "embedding alone (no attention, groups, transport or attribution to draw), so this "
        "run logs no maps figure.\n\nThe similarity Grad-CAM baseline (Selvaraju et al. 2017, "
        "Eq. 1-2, with the pair's cosine as the score) explains any run: "
        "`python -m harness explain --run RUN_ID` draws it and scores it against the part "
        "masks and with deletion and insertion curves; its figures go to this run's "
        "`explain/` artifacts (harness.engine.explain.explain_run).\n"
    )


def _makes_figure(head: Method, kind: str) -> bool:
    """Whether ``head`` is a :class:`~harness.methods.roles.FigureMaker` of ``kind`` tuples."""
    return isinstance(head, FigureMaker) and kind in head.figure_tuples


def _log_pair_figure(head: Method, batch: ImageBatch, out_dir: Path, tracker, label: str) -> None:
    """The head's pair figure of the first test image and its nearest neighbour."""
    if len(batch.pictures) < 2 or not _makes_figure(head, "pair"):
        return
    j = nearest_neighbour(batch.output.embedding)
    for path in write_tuple_figures(
        head,
        "pair",
        [batch.pictures[0], batch.pictures[j]],
        [batch.output.select(0), batch.output.select(j)],
        out_dir,
        caption=f"{label}, test image 1 and its nearest neighbour",
    ):
        tracker.log_artifact(path, "explanations")


def _log_triplet_figure(
    model, splits, protocol, device: torch.device, out_dir: Path, tracker, label: str
) -> None:
    """The head's triplet figure of the first test triplet (:func:`first_test_triplet`)."""
    triplet = first_test_triplet(splits.test.labels)
    if triplet is None or not _makes_figure(model.head, "triplet"):
        return
    batch = run_test_images(model, splits.test, protocol.image, triplet, device)
    for path in write_tuple_figures(
        model.head,
        "triplet",
        list(batch.pictures),
        [batch.output.select(i) for i in range(3)],
        out_dir,
        caption=f"{label}, a test triplet",
    ):
        tracker.log_artifact(path, "explanations")


def _log_maps_figure(
    batch: ImageBatch, maps: torch.Tensor, out_dir: Path, tracker, title: str
) -> None:
    """The maps over their pictures, the images ranked by the head's peak attention when it
    has one, else by map mass."""
    attention = batch.output.attention
    rank = attention.amax(dim=(2, 3)).cpu() if attention is not None else "mass"
    figure = attention_figure(
        batch.pictures, maps.cpu(), out_dir / "explanations.png", rank_by=rank, title=title
    )
    tracker.log_artifact(figure, "explanations")


def _log_part_mass(shares: np.ndarray, names: list[str], tracker, head_name: str) -> None:
    """Each map group's mass share per part, as ``explain/group<g>_mass_<part>`` metrics, as
    a text artifact and on stderr."""
    tracker.log_metrics(
        {
            metric_key("explain", f"group{g + 1}_mass_{names[j]}"): float(shares[g, j])
            for g in range(shares.shape[0])
            for j in range(len(names))
            if np.isfinite(shares[g, j])
        }
    )
    table = "\n".join(
        f"group {g + 1}: " + ", ".join(f"{names[j]} {shares[g, j]:.2f}" for j in range(len(names)))
        for g in range(shares.shape[0])
    )
    tracker.log_text(table, "explanations/part_mass.txt")
    print(
        f"{head_name} attention mass per part (test images):\n{table}", file=sys.stderr, flush=True
    )


# ------------------------------------------------- figures of python -m harness explain


def pairs_figure(
    path: Path,
    pictures_q,
    pictures_g,
    sources: dict[str, Any],
    rows_note: list[str],
    *,
    title: str = "",
) -> Path:
    """Rows: pairs; columns: query and gallery with each source's map overlaid (the SAM
    paper's Fig. 4 layout, one pair of columns per source), under ``title``. ``sources``:
    per source, an object with the ``query`` and ``gallery`` maps of the pairs
    (``(P, H, W)`` each)."""

    rows, cols = len(pictures_q), 2 * len(sources)
    fig = Figure(figsize=(1.8 * cols + 0.8, 1.9 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for r in range(rows):
        for s, (name, maps) in enumerate(sources.items()):
            draw_overlay(
                axes[r, 2 * s],
                pictures_q[r],
                maps.query[r],
                f"{name}: query" if r == 0 else "",
                fontsize=7,
                frame=True,
            )
            draw_overlay(
                axes[r, 2 * s + 1],
                pictures_g[r],
                maps.gallery[r],
                f"{name}: gallery" if r == 0 else "",
                fontsize=7,
                frame=True,
            )
        axes[r, 0].set_ylabel(rows_note[r], fontsize=7)
    heat_scale(fig, axes, SCORED_SCALE)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save_png(fig, path)


def strip_figure(
    path: Path,
    pictures: tuple[Any, Any],
    part_masks: tuple[np.ndarray, np.ndarray],
    columns: dict[str, tuple[Any, Any]],
    *,
    title: str = "",
) -> Path:
    """One pair explained by every source: rows query and gallery, a column per source
    (``columns``: title -> (query map, gallery map), any resolution), the differing part
    (``part_masks``: H x W booleans at the pictures' size) outlined in white on every
    panel, and a first column of the pictures with the part alone."""

    cols = 1 + len(columns)
    fig = Figure(figsize=(1.7 * cols + 0.8, 3.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, cols, squeeze=False)
    for r, side in enumerate(("query", "gallery")):
        draw_overlay(
            axes[r, 0],
            pictures[r],
            None,
            "differing part" if r == 0 else "",
            fontsize=7,
            frame=True,
        )
        for c, (name, maps) in enumerate(columns.items(), start=1):
            draw_overlay(
                axes[r, c], pictures[r], maps[r], name if r == 0 else "", fontsize=7, frame=True
            )
        for c in range(cols):
            axes[r, c].contour(
                part_masks[r].astype(float), levels=[0.5], colors="white", linewidths=1.2
            )
        axes[r, 0].set_ylabel(side, fontsize=8)
    heat_scale(fig, axes, SCORED_SCALE)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save_png(fig, path)


def curves_figure(path: Path, curves: dict[str, dict[str, np.ndarray]], *, title: str = "") -> Path:
    """Mean deletion and insertion curves per pixel order (RISE's Fig. 5 layout), under ``title``."""

    fig = Figure(figsize=(8, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, kind in zip(axes, ("deletion", "insertion"), strict=True):
        for name, c in curves.items():
            mean = c[kind].mean(0)
            ax.plot(
                c["fractions"], mean, label=f"{name} (AUC {np.trapezoid(mean, c['fractions']):.3f})"
            )
        ax.set_xlabel(
            f"fraction of the query's pixels {'removed' if kind == 'deletion' else 'revealed'}"
        )
        ax.set_ylabel("(1 + target score) / 2")
        ax.set_title(kind, fontsize=9)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save_png(fig, path)
