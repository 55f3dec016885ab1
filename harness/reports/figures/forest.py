"""Forest plots beside the tables: each method's paired difference to its block's baseline
row, with the 95% interval, per dataset.

What is drawn is exactly the paired-tests table's numbers (:func:`harness.reports.tables.paired.paired_tests`):
the mean paired difference over seeds (percent points) with its 95% Student t-interval
(filled marker, thick line), and where runs stored per-query results the paired bootstrap
over the test set's classes (the class bootstrap) with its percentile interval (open marker,
thin line, just below).
:func:`forest_rows` gives those numbers as a frame, written beside the figure as CSV
(:func:`write_forest`), so a reader (and a test) can check the plot against the table.

One metric per figure: the table's first metric that every dataset has (a paper's lead
metric: R@1 or P@1), named on the axis.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from harness.base.written import write_outputs
from harness.reports.tables.labels import DATASET_LABELS, METRIC_LABELS, block_label, row_label

__all__ = [
    "FOREST_COLUMNS",
    "forest_paths",
    "forest_rows",
    "lead_metric",
    "render_forest",
    "write_forest",
    "forest_files",
]

#: Columns of :func:`forest_rows` (and of the CSV beside each figure).
FOREST_COLUMNS = [
    "dataset",
    "block",
    "comparison",
    "metric",
    "pairs",
    "difference",
    "low",
    "high",
    "boot_difference",
    "boot_low",
    "boot_high",
]


def lead_metric(tests: pd.DataFrame, metrics: Sequence[str] = ()) -> str:
    """The first of ``metrics`` (else of the tests' own order) that every dataset's tests have."""
    datasets = set(tests["dataset"])
    for metric in [*metrics, *dict.fromkeys(tests["metric"])]:
        if set(tests.loc[tests["metric"] == metric, "dataset"]) == datasets:
            return metric
    return str(tests["metric"].iloc[0])


def forest_rows(tests: pd.DataFrame, labels: Mapping[str, str], metric: str) -> pd.DataFrame:
    """The paired tests of ``metric`` (``TEST_COLUMNS``, in table order) as plot rows
    (:data:`FOREST_COLUMNS`): block and comparison labelled as in the tables."""
    chosen = tests[tests["metric"] == metric]
    rows = [
        {
            "dataset": t.dataset,
            "block": block_label(t.backbone, t.loss),
            "comparison": f"{row_label(t.method, t.setting, labels)} vs {labels[t.baseline]}",
            "metric": t.metric,
            "pairs": t.pairs,
            "difference": t.difference,
            "low": t.low,
            "high": t.high,
            "boot_difference": t.boot_difference if t.boot_queries else math.nan,
            "boot_low": t.boot_low if t.boot_queries else math.nan,
            "boot_high": t.boot_high if t.boot_queries else math.nan,
        }
        for t in chosen.itertuples(index=False)
    ]
    return pd.DataFrame(rows, columns=FOREST_COLUMNS)


def _positions(rows: pd.DataFrame) -> tuple[list[str], list[bool], dict[tuple[str, str], float]]:
    """Y tick labels (a block heading, then its comparisons), which ticks are headings, and the
    y of each (block, comparison), top to bottom."""
    ticks, headings, where = [], [], {}
    for block in dict.fromkeys(rows["block"]):
        ticks.append(block)
        headings.append(True)
        for comparison in dict.fromkeys(rows.loc[rows["block"] == block, "comparison"]):
            where[(block, comparison)] = -float(len(ticks))
            ticks.append(comparison)
            headings.append(False)
    return ticks, headings, where


def render_forest(
    rows: pd.DataFrame, *, metric_label: str, baseline_label: str, dataset_labels: Mapping[str, str]
) -> tuple[bytes, bytes]:
    """``(pdf, png)`` of a forest plot: one panel per dataset, a row per comparison grouped by
    block, the zero line drawn, differences in percent points."""

    datasets = list(dict.fromkeys(rows["dataset"]))
    ticks, headings, where = _positions(rows)
    longest = max(len(t) for t in ticks)
    figure = Figure(
        figsize=(1.2 + 0.075 * longest + 2.6 * len(datasets), 1.4 + 0.28 * len(ticks)),
        layout="constrained",
    )
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(datasets), sharey=True, squeeze=False)[0]
    for ax, dataset in zip(axes, datasets, strict=True):
        _forest_intervals(ax, rows[rows["dataset"] == dataset], where)
        ax.set_title(dataset_labels.get(dataset, dataset), fontsize=10)
        ax.set_xlabel(
            f"{metric_label}: difference to {baseline_label}\n(percent points, 95% interval)",
            fontsize=9,
        )
        ax.grid(axis="x", color="0.9", linewidth=0.6)
        ax.tick_params(labelsize=8)
    axes[0].set_yticks([-float(i) for i in range(len(ticks))], ticks)
    axes[0].set_ylim(-len(ticks) + 0.4, 0.6)
    for label, heading in zip(axes[0].get_yticklabels(), headings, strict=True):
        label.set_fontweight("bold" if heading else "normal")
        label.set_fontsize(8.5 if heading else 8)
    if rows["boot_difference"].notna().any():
        _forest_legend(figure)
    return _figure_bytes(figure, "pdf"), _figure_bytes(figure, "png")


def _forest_intervals(ax, part: pd.DataFrame, where: Mapping[tuple[str, str], float]) -> None:
    """One dataset's panel: the zero line, and per comparison its difference with the
    interval over seeds and, where it has one, the paired bootstrap's just below."""
    ax.axvline(0.0, color="0.3", linewidth=0.9, linestyle="--", zorder=1)
    for r in part.itertuples(index=False):
        y = where[(r.block, r.comparison)]
        if not math.isnan(r.low):
            ax.plot(
                [r.low, r.high],
                [y, y],
                color="C0",
                linewidth=2.2,
                solid_capstyle="butt",
                zorder=2,
            )
        ax.plot([r.difference], [y], "o", color="C0", markersize=5, zorder=3)
        if not math.isnan(r.boot_difference):
            ax.plot(
                [r.boot_low, r.boot_high],
                [y - 0.28, y - 0.28],
                color="C1",
                linewidth=1.0,
                zorder=2,
            )
            ax.plot(
                [r.boot_difference],
                [y - 0.28],
                "o",
                markerfacecolor="white",
                color="C1",
                markersize=4,
                zorder=3,
            )


def _forest_legend(figure) -> None:
    """The legend of the two intervals (over seeds, over test classes), below the panels."""

    figure.legend(
        handles=[
            Line2D([], [], color="C0", marker="o", linewidth=2.2, label="over seeds (paired t)"),
            Line2D(
                [],
                [],
                color="C1",
                marker="o",
                markerfacecolor="white",
                linewidth=1.0,
                label="over test classes (class bootstrap)",
            ),
        ],
        loc="outside lower center",
        ncols=2,
        fontsize=8,
        frameon=False,
    )


def _figure_bytes(figure, fmt: str) -> bytes:
    """``figure`` saved as ``fmt`` (pdf: without a creation date, so the bytes repeat)."""
    buffer = io.BytesIO()
    figure.savefig(
        buffer, format=fmt, dpi=150, metadata={"CreationDate": None} if fmt == "pdf" else None
    )
    return buffer.getvalue()


def forest_paths(stem: Path) -> list[Path]:
    """The files :func:`write_forest` writes for ``stem``: ``.forest.pdf``, ``.png``, ``.csv``."""
    return [stem.with_name(f"{stem.name}.forest.{ext}") for ext in ("pdf", "png", "csv")]


def write_forest(
    stem: Path, tests: pd.DataFrame, labels: Mapping[str, str], *, metrics: Sequence[str] = ()
) -> list[Path]:
    """``<stem>.forest.pdf``, ``.png`` and ``.csv`` (the numbers drawn), written together
    (:func:`harness.base.atomic.atomic_write_set`); nothing when there are no paired tests.
    Returns the paths written."""

    files = forest_files(stem, tests, labels, metrics=metrics)
    write_outputs(files)
    return list(files)


def forest_files(
    stem: Path, tests: pd.DataFrame, labels: Mapping[str, str], *, metrics: Sequence[str] = ()
) -> dict[Path, bytes | str]:
    """The contents of :func:`write_forest`'s files by path, rendered, not written (empty
    when there are no paired tests): a caller writes them with its own files as one set."""
    if tests is None or tests.empty:
        return {}
    metric = lead_metric(tests, metrics)
    rows = forest_rows(tests, labels, metric)
    pdf, png = render_forest(
        rows,
        metric_label=METRIC_LABELS.get(metric, metric),
        baseline_label=labels[tests["baseline"].iloc[0]],
        dataset_labels=DATASET_LABELS,
    )
    paths = forest_paths(stem)
    return {
        paths[0]: pdf,
        paths[1]: png,
        paths[2]: rows.to_csv(index=False, float_format="%.6f"),
    }
