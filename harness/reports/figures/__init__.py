"""Figures the harness draws from runs: the forest plots beside the tables
(:mod:`~harness.reports.figures.forest`), and the retrieval examples and embedding map each
finished run logs with it (:mod:`~harness.reports.figures.retrieval`,
:mod:`~harness.reports.figures.embedding_map`, both rendered together by
:mod:`~harness.reports.figures.views`). Each is drawn on a matplotlib Agg canvas, without
pyplot or a global backend."""

from harness.reports.figures.embedding_map import (
    MAP_POINTS,
    MIN_MAP_POINTS,
    TSNE_ITERATIONS,
    class_colours,
    draw_embedding_map,
    map_sample,
    tsne_points,
)
from harness.reports.figures.forest import (
    FOREST_COLUMNS,
    forest_files,
    forest_paths,
    forest_rows,
    lead_metric,
    render_forest,
    write_forest,
)
from harness.reports.figures.retrieval import (
    CORRECT_COLOUR,
    NEIGHBOURS,
    QUERY_COLOUR,
    QUERY_GROUPS,
    WRONG_COLOUR,
    RetrievalExample,
    draw_retrieval_examples,
    frame_colours,
    group_sizes,
    select_queries,
    top_neighbours,
)
from harness.reports.figures.views import (
    EXAMPLES_DATA,
    EXAMPLES_FIGURE,
    MAP_DATA,
    MAP_FIGURE,
    VIEWS_FOLDER,
    ViewData,
    retrieval_examples,
    views_files,
    write_views,
)

__all__ = [
    "FOREST_COLUMNS",
    "forest_paths",
    "forest_rows",
    "lead_metric",
    "render_forest",
    "write_forest",
    "forest_files",
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
    "MAP_POINTS",
    "MIN_MAP_POINTS",
    "TSNE_ITERATIONS",
    "map_sample",
    "tsne_points",
    "class_colours",
    "draw_embedding_map",
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
