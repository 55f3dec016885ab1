"""The retrieval examples logged with a run: a few test queries, each beside its top
neighbours in the searched set, every neighbour framed green where it shares the query's
class and red where it does not, the query's AP@R above its row.

Which queries: :func:`select_queries` takes, from the per-query AP@R, the worst, the best
and seeded random ones (a third each), so that a reader sees the failures and the
successes of the same run, and a sample of the ordinary. Their neighbours are the cosine
top k of the embeddings (:func:`top_neighbours`), found by the evaluation's own exact
search (:func:`harness.components.evaluation.knn`: decreasing similarity, ties by index).
:func:`draw_retrieval_examples` draws them on an Agg canvas (no pyplot, no global backend
change).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.components.evaluation import drop_self, knn, l2_normalize

__all__ = [
    "NEIGHBOURS",
    "QUERY_GROUPS",
    "CORRECT_COLOUR",
    "WRONG_COLOUR",
    "QUERY_COLOUR",
    "RetrievalExample",
    "group_sizes",
    "select_queries",
    "top_neighbours",
    "frame_colours",
    "draw_retrieval_examples",
]

#: Neighbours drawn beside each query.
NEIGHBOURS = 5
#: Why a query was chosen, in the order of the figure's rows.
QUERY_GROUPS = ("worst", "best", "random")
#: Frames: a neighbour of the query's class, one of another class, the query itself.
CORRECT_COLOUR, WRONG_COLOUR, QUERY_COLOUR = "#1a9641", "#d7191c", "#2b2b2b"
FRAME_WIDTH = 3.0


@dataclass(frozen=True)
class RetrievalExample:
    """One row of the figure: the ``query`` (its index in the test split), the ``group``
    it was chosen from (:data:`QUERY_GROUPS`), its ``value`` (AP@R), its class ``label``,
    and its ``neighbours`` (indices into the searched set, best first) with their labels."""

    query: int
    group: str
    value: float
    label: int
    neighbours: tuple[int, ...]
    neighbour_labels: tuple[int, ...]

    @property
    def correct(self) -> tuple[bool, ...]:
        """Per neighbour, whether it shares the query's class."""
        return tuple(label == self.label for label in self.neighbour_labels)

    def record(self) -> dict[str, Any]:
        """The row as JSON data (what the figure draws, for a reader or a check)."""
        return {
            "query": self.query,
            "group": self.group,
            "ap_at_r": self.value,
            "label": self.label,
            "neighbours": list(self.neighbours),
            "neighbour_labels": list(self.neighbour_labels),
            "correct": list(self.correct),
        }


def group_sizes(count: int) -> tuple[int, int, int]:
    """Queries taken as the worst, the best and at random for ``count`` rows: a third each,
    a remainder going to the worst first, then to the best."""
    return (count + 2) // 3, (count + 1) // 3, count // 3


def select_queries(values: np.ndarray, count: int, seed: int) -> list[tuple[int, str]]:
    """``(query index, group)`` of up to ``count`` distinct queries, by ``values`` (one per
    query; NaN for a query that has no other item of its class, which none is taken from):
    the lowest first (ties: lower index first), then the highest of the others, then a
    seeded random draw (``seed``: the run's) from the rest, in index order. Fewer than
    ``count`` when fewer queries have a value."""
    values = np.asarray(values, dtype=np.float64)
    eligible = np.flatnonzero(np.isfinite(values))
    worst_n, best_n, random_n = group_sizes(count)
    ascending = eligible[np.argsort(values[eligible], kind="stable")]
    worst, rest = ascending[:worst_n], ascending[worst_n:]
    best = rest[np.argsort(-values[rest], kind="stable")][:best_n]
    left = np.setdiff1d(rest, best)
    rng = np.random.default_rng(seed)
    drawn = np.sort(rng.choice(left, size=min(random_n, len(left)), replace=False))
    return [
        (int(index), group)
        for group, chosen in zip(QUERY_GROUPS, (worst, best, drawn), strict=True)
        for index in chosen
    ]


def top_neighbours(
    query: np.ndarray, gallery: np.ndarray | None, rows: Sequence[int], k: int = NEIGHBOURS
) -> np.ndarray:
    """The top ``k`` neighbours (len(rows) x k' indices, k' = k or fewer where the searched
    set is smaller) of the query embeddings ``rows`` by cosine: in ``gallery`` where given,
    else in ``query`` without the query itself (removed by index, as the evaluation does)."""
    query = l2_normalize(query)
    ids = np.asarray(rows, dtype=np.int64)
    if gallery is not None:
        return knn(query[ids], l2_normalize(gallery), k)[0]
    indices, sims = knn(query[ids], query, k + 1)
    return drop_self(indices, sims, ids)[0][:, :k]


def frame_colours(example: RetrievalExample) -> list[str]:
    """The frame of each neighbour of ``example``: :data:`CORRECT_COLOUR` for its class,
    :data:`WRONG_COLOUR` for another."""
    return [CORRECT_COLOUR if hit else WRONG_COLOUR for hit in example.correct]


def draw_retrieval_examples(
    examples: Sequence[RetrievalExample],
    pictures: Sequence[Sequence[np.ndarray]],
    *,
    caption: str = "",
) -> Figure:
    """The figure of ``examples``, a row each: the query (framed :data:`QUERY_COLOUR`) and
    its neighbours (framed by :func:`frame_colours`), titled with the query's group, AP@R
    and class. ``pictures``: per row, the query's picture then its neighbours' (H x W x 3
    uint8 or floats in [0, 1]). The axes are row by row, query first."""
    cols = 1 + max((len(e.neighbours) for e in examples), default=0)
    height = 1.45 * max(len(examples), 1) + 0.5
    figure = Figure(figsize=(1.25 * cols + 0.2, height))
    FigureCanvasAgg(figure)
    axes = figure.subplots(max(len(examples), 1), cols, squeeze=False)
    for row, (example, drawn) in enumerate(zip(examples, pictures, strict=True)):
        colours = [QUERY_COLOUR, *frame_colours(example)]
        for col, ax in enumerate(axes[row]):
            if col >= len(drawn):
                ax.axis("off")
                continue
            _framed(ax, drawn[col], colours[col])
            if col:
                ax.set_title(f"{col}", fontsize=7, color=colours[col])
        axes[row, 0].set_title(
            f"{example.group}: AP@R {example.value:.2f}, class {example.label}",
            fontsize=8,
            loc="left",
        )
    if not examples:
        axes[0, 0].axis("off")
    if caption:
        figure.suptitle(caption, fontsize=9)
    figure.subplots_adjust(
        left=0.02, right=0.98, bottom=0.1 / height, top=1 - 0.5 / height, wspace=0.08, hspace=0.35
    )
    return figure


def _framed(ax, picture: np.ndarray, colour: str) -> None:
    """``picture`` on ``ax`` with no ticks and a frame of ``colour`` (the axes' spines)."""
    ax.imshow(picture)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_edgecolor(colour)
        spine.set_linewidth(FRAME_WIDTH)
