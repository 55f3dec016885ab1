"""One near-miss pair explained by every method (``explain-table --strip``): each run is
rebuilt from the store, the same pair of test images is drawn for it (the pair sampling of
``explain``, from the same seed), and its maps go into one column of a strip, with the
differing part outlined (:func:`~harness.reports.explanations.strip_figure`). A method
with maps of its own shows them; one without shows the Grad-CAM baseline on its model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.base.errors import HarnessError
from harness.engine.explain.maps import (
    Pairs,
    compute_maps,
    load_images,
    load_run,
    near_miss_pairs,
    part_labels,
    to_pictures,
)
from harness.reports.explanations import strip_figure

__all__ = ["explain_strip"]


def _one_pair(ctx, seed: int, pair: int) -> Pairs:
    """The ``pair``-th near-miss pair ``explain --seed seed`` scores first on this run."""
    pairs = near_miss_pairs(ctx, pair + 1, np.random.default_rng(seed))
    if pairs is None:
        raise HarnessError(
            f"run {ctx.run_id}: dataset '{ctx.dataset}' records no near-miss classes with "
            f"part masks; a strip needs them (the synthetic dataset has them)"
        )
    rows = slice(pair, pair + 1)
    return Pairs(
        pairs.query[rows], pairs.gallery[rows], pairs.same[rows], pairs.region[rows], pairs.kind
    )


def explain_strip(
    run_ids: list[str],
    path: Path,
    *,
    seed: int = 0,
    pair: int = 0,
    checkpoint_root: Path | None = None,
    device: str = "auto",
) -> Path:
    """The strip of ``run_ids`` (one column each, in order) written to ``path``; runs
    whose pair is not the first run's (another dataset or split) are one error line."""
    columns: dict[str, tuple] = {}
    first: tuple | None = None
    pictures = masks = None
    for run_id in run_ids:
        ctx = load_run(run_id, checkpoint_root=checkpoint_root, device=device)
        one = _one_pair(ctx, seed, pair)
        keys = ctx.splits.test.keys()
        identity = (keys[int(one.query[0])], keys[int(one.gallery[0])], int(one.region[0]))
        if first is None:
            first = identity
            images = load_images(ctx, np.concatenate([one.query, one.gallery]))
            pictures = tuple(to_pictures(ctx, images))
            labels = part_labels(ctx, np.concatenate([one.query, one.gallery]))
            assert labels is not None  # near-miss pairs come with part masks
            masks = tuple((labels == one.region[0]).numpy())
        elif identity != first:
            raise HarnessError(
                f"run {run_id} draws another pair ({identity[0]} / {identity[1]}) than run "
                f"{run_ids[0]} ({first[0]} / {first[1]}): a strip compares runs of one dataset"
            )
        own, baseline, _, _ = compute_maps(ctx, one, batch=1)
        maps, label = (own, ctx.method) if own is not None else (baseline, f"{ctx.method} Grad-CAM")
        columns[label] = (maps.query[0], maps.gallery[0])
    assert pictures is not None and masks is not None and first is not None
    part = ["", *ctx.splits.extras.get("parts", [])][first[2]]
    title = f"one near-miss pair (differing part: {part}), explained by each run's maps"
    return strip_figure(path, pictures, masks, columns, title=title)
