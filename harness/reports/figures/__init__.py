"""Figures the harness draws from runs: the forest plots beside the tables
(:mod:`~harness.reports.figures.forest`). Each is drawn on a matplotlib Agg canvas, without
pyplot or a global backend."""

from harness.reports.figures.forest import (
    FOREST_COLUMNS,
    forest_files,
    forest_paths,
    forest_rows,
    lead_metric,
    render_forest,
    write_forest,
)

__all__ = [
    "FOREST_COLUMNS",
    "forest_paths",
    "forest_rows",
    "lead_metric",
    "render_forest",
    "write_forest",
    "forest_files",
]
