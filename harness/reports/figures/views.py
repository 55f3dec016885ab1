"""The two figures a finished run logs with it, from its test embeddings: the retrieval
examples (:mod:`~harness.reports.figures.retrieval`) and the embedding map
(:mod:`~harness.reports.figures.embedding_map`), each with the data it draws beside it.

:func:`views_files` renders them (nothing is written: the contents by path), and
:func:`write_views` writes them as one set into a folder; the engine logs them under
:data:`VIEWS_FOLDER` of the run. The pictures are the test images as the evaluation saw
them (the protocol's evaluation transform: resize and centre crop).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from harness.base.atomic import finite_json
from harness.base.written import write_outputs
from harness.components.data import ImageSet
from harness.components.data.transforms import build_transform
from harness.reports.figures.embedding_map import (
    MAP_POINTS,
    MIN_MAP_POINTS,
    draw_embedding_map,
    map_sample,
    tsne_points,
)
from harness.reports.figures.retrieval import (
    NEIGHBOURS,
    RetrievalExample,
    draw_retrieval_examples,
    select_queries,
    top_neighbours,
)

__all__ = [
    "VIEWS_FOLDER",
    "EXAMPLES_FIGURE",
    "EXAMPLES_DATA",
    "MAP_FIGURE",
    "MAP_DATA",
    "ViewData",
    "retrieval_examples",
    "views_files",
    "write_views",
]

#: The run's artifact folder of both figures and their data.
VIEWS_FOLDER = "views"
#: The retrieval examples (PNG) and their rows (JSON: query, group, AP@R, class, neighbours).
EXAMPLES_FIGURE, EXAMPLES_DATA = "retrieval_examples.png", "retrieval_examples.json"
#: The embedding map (PNG) and its points (CSV: test index, label, x, y, example row).
MAP_FIGURE, MAP_DATA = "embedding_map.png", "embedding_map.csv"


@dataclass(frozen=True, eq=False)
class ViewData:
    """What both figures are drawn from: the test split's ``embeddings`` (Q x D) and
    images, each query's ``values`` (AP@R; NaN where it has no other item of its class),
    the ``gallery`` searched and its images where the split has one (None: the queries
    search each other), the protocol's image spec, the ``count`` of examples, the run's
    ``seed`` (the random queries, the map's sample and t-SNE) and a ``caption`` naming
    the run."""

    embeddings: np.ndarray
    images: ImageSet
    values: np.ndarray
    image_spec: Any
    count: int
    seed: int
    caption: str = ""
    gallery: np.ndarray | None = None
    gallery_images: ImageSet | None = None
    #: Most points the embedding map draws (the protocol's ``evaluation.map_points``).
    map_points: int = MAP_POINTS


def retrieval_examples(views: ViewData) -> list[RetrievalExample]:
    """The rows of the retrieval examples: the chosen queries
    (:func:`~harness.reports.figures.retrieval.select_queries`) with their cosine top
    :data:`~harness.reports.figures.retrieval.NEIGHBOURS`."""
    chosen = select_queries(views.values, views.count, views.seed)
    if not chosen:
        return []
    rows = [query for query, _ in chosen]
    found = top_neighbours(views.embeddings, views.gallery, rows, NEIGHBOURS)
    searched = views.images if views.gallery_images is None else views.gallery_images
    labels = views.images.labels
    return [
        RetrievalExample(
            query=query,
            group=group,
            value=float(views.values[query]),
            label=int(labels[query]),
            neighbours=tuple(int(i) for i in neighbours),
            neighbour_labels=tuple(int(searched.labels[i]) for i in neighbours),
        )
        for (query, group), neighbours in zip(chosen, found, strict=True)
    ]


def views_files(views: ViewData, out_dir: Path) -> dict[Path, bytes | str]:
    """The contents of both figures and their data by path in ``out_dir``, rendered, not
    written: the retrieval examples when a query has a value, the map when the test split
    has :data:`~harness.reports.figures.embedding_map.MIN_MAP_POINTS` images or more."""
    examples = retrieval_examples(views)
    files: dict[Path, bytes | str] = {}
    if examples:
        what = f"test queries and their cosine top {NEIGHBOURS} (green: same class, red: other)"
        figure = draw_retrieval_examples(
            examples, _pictures(views, examples), caption=_caption(views, what)
        )
        files[out_dir / EXAMPLES_FIGURE] = _png(figure)
        records = finite_json([e.record() for e in examples])
        files[out_dir / EXAMPLES_DATA] = json.dumps(records, indent=2, allow_nan=False) + "\n"
    if len(views.embeddings) >= MIN_MAP_POINTS:
        figure, points = _embedding_map(views, examples)
        files[out_dir / MAP_FIGURE] = _png(figure)
        files[out_dir / MAP_DATA] = points.to_csv(index=False, float_format="%.5f")
    return files


def write_views(views: ViewData, out_dir: Path) -> list[Path]:
    """Write :func:`views_files` into ``out_dir`` as one set; returns the paths written."""
    files = views_files(views, out_dir)
    write_outputs(files)
    return list(files)


def _embedding_map(
    views: ViewData, examples: list[RetrievalExample]
) -> tuple[Figure, pd.DataFrame]:
    """The map of a sample of the test embeddings (the example queries in it) and its
    points: test index, label, coordinates and the example row a query heads (0: none)."""
    queries = [e.query for e in examples]
    sample = map_sample(len(views.embeddings), queries, views.seed, limit=views.map_points)
    points = tsne_points(views.embeddings[sample], views.seed)
    labels = views.images.labels[sample]
    position = {int(index): p for p, index in enumerate(sample)}
    rows = [(position[query], row) for row, query in enumerate(queries, start=1)]
    figure = draw_embedding_map(
        points, labels, rows, caption=_caption(views, f"t-SNE of {len(sample)} test embeddings")
    )
    example_row = np.zeros(len(sample), dtype=np.int64)
    for p, row in rows:
        example_row[p] = row
    data = pd.DataFrame(
        {
            "index": sample,
            "label": labels,
            "x": points[:, 0],
            "y": points[:, 1],
            "example_row": example_row,
        }
    )
    return figure, data


def _pictures(views: ViewData, examples: list[RetrievalExample]) -> list[list[np.ndarray]]:
    """Per example, the query's picture then its neighbours', as the evaluation saw them."""
    transform = build_transform(views.image_spec, train=False)
    searched = views.images if views.gallery_images is None else views.gallery_images

    def picture(images: ImageSet, index: int) -> np.ndarray:
        return transform(images.read(index)).permute(1, 2, 0).numpy()

    return [
        [picture(views.images, e.query), *(picture(searched, i) for i in e.neighbours)]
        for e in examples
    ]


def _caption(views: ViewData, what: str) -> str:
    return f"{views.caption}: {what}" if views.caption else what


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()
