"""The explanation figures and part statistics logged with a trained run.

For heads that explain (:meth:`methods.base.Method.explain` and the figure hooks), the
engine calls :func:`log_explanations` after the test evaluation; the maps and figures
come from :mod:`harness.components.explanation.maps`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.components.explanation.maps import attention_figure, part_attention_mass, upsample_maps

__all__ = ["log_explanations", "pairs_figure", "curves_figure"]


@torch.inference_mode()
def _a_test_triplet(labels: np.ndarray) -> tuple[int, int, int] | None:
    """(anchor, positive, negative) test indices: the first image, the next of its class,
    the first of another class; None when the split has no such triplet."""
    labels = np.asarray(labels)
    same = np.flatnonzero(labels == labels[0])
    other = np.flatnonzero(labels != labels[0])
    if len(same) < 2 or not len(other):
        return None
    return 0, int(same[1]), int(other[0])


def log_explanations(model, splits, protocol, device: torch.device, out_dir: Path, tracker,
                     count: int = 48) -> None:
    """For heads that explain: a figure of their maps on test images, and, where the
    dataset has part masks (``synthetic``), the share of each map's mass on each part.

    Mass uses the head's raw spatial attention when it has one (``output.attention``,
    upsampled without re-normalisation), else the explanation maps.
    """
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    from harness.components.data.transforms import build_transform, normalize_batch
    from methods import Method

    model.eval()
    n = min(count, len(splits.test))
    transform = build_transform(protocol.image, train=False)
    images = normalize_batch(torch.stack([transform(splits.test.read(i)) for i in range(n)]).to(device),
                             protocol.image)
    out = model(images)
    mean = torch.tensor(protocol.image.mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(protocol.image.std, device=device).view(1, 3, 1, 1)
    pictures = (images * std + mean).clamp(0, 1).cpu()
    if n >= 2:  # the first test image and its nearest neighbour among the others
        sims = out.embedding[1:] @ out.embedding[0]
        j = 1 + int(sims.argmax())
        pair = model.head.pair_figure(pictures[0], pictures[j], out.select(0), out.select(j), out_dir / "pair.png")
        for written in ([] if pair is None else pair if isinstance(pair, list) else [pair]):
            tracker.log_artifact(Path(written), "explanations")
    triplet = _a_test_triplet(splits.test.labels)
    if triplet is not None and type(model.head).triplet_figure is not Method.triplet_figure:
        batch = normalize_batch(torch.stack([transform(splits.test.read(i)) for i in triplet]).to(device),
                                protocol.image)
        outputs = model(batch)
        pictures3 = (batch * std + mean).clamp(0, 1).cpu()
        written = model.head.triplet_figure(list(pictures3), [outputs.select(i) for i in range(3)],
                                            out_dir / "triplet.png")
        for path in written or []:
            tracker.log_artifact(Path(path), "explanations")
    maps = model.head.explain(images, out)
    if maps is None:
        return
    rank = out.attention.amax(dim=(2, 3)).cpu() if out.attention is not None else "mass"
    figure = attention_figure(pictures, maps.cpu(), out_dir / "explanations.png", rank_by=rank)
    tracker.log_artifact(figure, "explanations")
    masks = splits.extras.get("masks")
    if not masks:
        return
    from harness.components.data.synthetic import load_part_mask

    size = protocol.image.size
    labels = []
    for i in range(n):
        mask = load_part_mask(splits.extras["root"], masks[splits.test.keys()[i]])
        mask = TF.center_crop(TF.resize(torch.from_numpy(mask.copy())[None], protocol.image.resize,
                                        interpolation=InterpolationMode.NEAREST), size)
        labels.append(mask[0])
    raw = out.attention if out.attention is not None else maps
    mass_maps = upsample_maps(raw.float(), (size, size), normalize=False).clamp_min(0).cpu()
    shares = part_attention_mass(mass_maps, torch.stack(labels), num_parts=len(splits.extras["parts"]))
    names = ["background", *splits.extras["parts"]]
    tracker.log_metrics({f"explain_group{g + 1}_mass_{names[j]}": float(shares[g, j])
                         for g in range(shares.shape[0]) for j in range(len(names))
                         if np.isfinite(shares[g, j])})
    table = "\n".join(f"group {g + 1}: " + ", ".join(f"{names[j]} {shares[g, j]:.2f}" for j in range(len(names)))
                      for g in range(shares.shape[0]))
    tracker.log_text(table, "explanations/part_mass.txt")
    print(f"{model.head.registry_name if hasattr(model.head, 'registry_name') else ''} attention mass "
         f"per part (test images):\n{table}", file=sys.stderr, flush=True)


# ------------------------------------------------- figures of python -m harness explain


def _overlay(ax, picture, heat, title: str = "") -> None:
    from harness.components.explanation.maps import minmax_normalize

    ax.imshow(picture.permute(1, 2, 0).numpy())
    ax.imshow(minmax_normalize(heat[None, None])[0, 0].numpy(), cmap="jet", alpha=0.5, vmin=0, vmax=1)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=7)


def pairs_figure(path: Path, pictures_q, pictures_g, sources: dict[str, Any], rows_note: list[str]) -> Path:
    """Rows: pairs; columns: query and gallery with each source's map overlaid (the SAM
    paper's Fig. 4 layout, one pair of columns per source). ``sources``: per source, an
    object with the ``query`` and ``gallery`` maps of the pairs (``(P, H, W)`` each)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, cols = len(pictures_q), 2 * len(sources)
    fig = Figure(figsize=(1.8 * cols, 1.9 * rows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for r in range(rows):
        for s, (name, maps) in enumerate(sources.items()):
            _overlay(axes[r, 2 * s], pictures_q[r], maps.query[r], f"{name}: query" if r == 0 else "")
            _overlay(axes[r, 2 * s + 1], pictures_g[r], maps.gallery[r], f"{name}: gallery" if r == 0 else "")
        axes[r, 0].set_ylabel(rows_note[r], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def curves_figure(path: Path, curves: dict[str, dict[str, np.ndarray]]) -> Path:
    """Mean deletion and insertion curves per pixel order (RISE's Fig. 5 layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, kind in zip(axes, ("deletion", "insertion"), strict=True):
        for name, c in curves.items():
            mean = c[kind].mean(0)
            ax.plot(c["fractions"], mean, label=f"{name} (AUC {np.trapezoid(mean, c['fractions']):.3f})")
        ax.set_xlabel(f"fraction of the query's pixels {'removed' if kind == 'deletion' else 'revealed'}")
        ax.set_ylabel("(1 + target score) / 2")
        ax.set_title(kind, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
