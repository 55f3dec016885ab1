"""The embedding map logged with a run: its test embeddings in two dimensions by
scikit-learn's t-SNE, a point per image coloured by its class, the classes of the run's
retrieval examples (:mod:`harness.reports.figures.retrieval`) drawn larger and outlined, and
the example queries themselves as stars numbered by their row in that figure.

Kept cheap, so that every run can afford it: at most :data:`MAP_POINTS` points (a seeded
sample, the example queries always in it), Barnes-Hut t-SNE with :data:`TSNE_ITERATIONS`
steps from a PCA start, its seed the run's, so that the same run draws the same map, on
one thread: scikit-learn's OpenMP threads wait for each other by spinning, which on a
busy machine (sweep workers side by side) costs many times the work itself. Measured on 2 cores busy with
another process: 240 points took 12 s on two threads, 0.4 s on one; 5,000 points (64-D)
take about 10 s on one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from sklearn.manifold import TSNE
from threadpoolctl import threadpool_limits

from harness.components.evaluation import l2_normalize

__all__ = [
    "MAP_POINTS",
    "MIN_MAP_POINTS",
    "TSNE_ITERATIONS",
    "map_sample",
    "tsne_points",
    "class_colours",
    "draw_embedding_map",
]

#: Most points a map shows: t-SNE's time grows about as N log N, and a few thousand points
#: already show a test set's class structure.
MAP_POINTS = 5000
#: Fewest points a map is drawn from (t-SNE's perplexity must stay below the points).
MIN_MAP_POINTS = 4
#: t-SNE's optimisation steps (scikit-learn's ``max_iter``; its default is 1,000, its
#: least 250, of which the first 250 exaggerate the clusters). 500 leaves 250 steps to
#: settle: enough for a map to read the classes from, at half the default's cost.
TSNE_ITERATIONS = 500
#: The palette the classes cycle through.
PALETTE = "tab20"


def map_sample(count: int, keep: Sequence[int], seed: int, limit: int = MAP_POINTS) -> np.ndarray:
    """Sorted indices of the points a map of ``count`` points shows: all when ``count <=
    limit``, else ``keep`` and a draw (seeded by ``seed``) from the others, ``limit`` in all."""
    if count <= limit:
        return np.arange(count)
    kept = np.unique(np.asarray(keep, dtype=np.int64))
    others = np.setdiff1d(np.arange(count), kept)
    rng = np.random.default_rng(seed)
    drawn = rng.choice(others, size=max(limit - len(kept), 0), replace=False)
    return np.sort(np.concatenate([kept, drawn]))


def tsne_points(embeddings: np.ndarray, seed: int) -> np.ndarray:
    """N x 2 t-SNE coordinates of ``embeddings`` (N x D, L2-normalised first, as retrieval
    compares them): PCA start, :data:`TSNE_ITERATIONS` steps, ``random_state=seed``,
    perplexity 30 or less for a small N, on one thread."""
    points = l2_normalize(embeddings)
    perplexity = min(30.0, max(1.0, (len(points) - 1) / 3))
    tsne = TSNE(
        n_components=2,
        perplexity=perplexity,
        init="pca",
        learning_rate="auto",
        max_iter=TSNE_ITERATIONS,
        random_state=seed,
    )
    with threadpool_limits(limits=1):
        return np.asarray(tsne.fit_transform(points), dtype=np.float64)


def class_colours(labels: np.ndarray) -> np.ndarray:
    """N x 4 RGBA colour per point: its class's, the classes in label order cycling through
    :data:`PALETTE`."""
    codes = np.unique(np.asarray(labels), return_inverse=True)[1].ravel()
    palette = colormaps[PALETTE]
    return np.asarray(palette(codes % palette.N))


def draw_embedding_map(
    points: np.ndarray,
    labels: np.ndarray,
    queries: Sequence[tuple[int, int]] = (),
    *,
    caption: str = "",
) -> Figure:
    """The map of ``points`` (N x 2) coloured by ``labels``: the classes of the ``queries``
    (``(position in points, row number)`` of each retrieval example) larger and outlined,
    each query a star with its row number beside it, and a legend of those classes."""
    labels = np.asarray(labels)
    colours = class_colours(labels)
    marked_classes = list(dict.fromkeys(int(labels[p]) for p, _ in queries))
    marked = np.isin(labels, marked_classes)
    figure = Figure(figsize=(6.4, 6.0), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    rest = points[~marked]
    ax.scatter(rest[:, 0], rest[:, 1], s=6, c=colours[~marked], alpha=0.45, linewidths=0)
    ax.scatter(
        points[marked, 0],
        points[marked, 1],
        s=18,
        c=colours[marked],
        edgecolors="black",
        linewidths=0.4,
    )
    for position, row in queries:
        x, y = points[position]
        ax.scatter([x], [y], s=160, marker="*", c=colours[[position]], edgecolors="black")
        ax.annotate(str(row), (x, y), xytext=(5, 5), textcoords="offset points", fontsize=8)
    handles = [
        Line2D(
            [],
            [],
            marker="o",
            linestyle="",
            markeredgecolor="black",
            markeredgewidth=0.4,
            color=colours[np.flatnonzero(labels == c)[0]],
            label=f"class {c}",
        )
        for c in marked_classes
    ]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="best", ncols=1 + len(handles) // 12)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(caption, fontsize=9)
    return figure
