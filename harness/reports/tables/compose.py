"""A whole table from the tracking store: the request (experiments and options), the
steps that turn its runs into a rendered :class:`Table`, and writing it."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.base.atomic import atomic_write_text
from harness.base.errors import HarnessError, unknown_name
from harness.reports.stats import CORRECTIONS
from harness.reports.tables.chance import CHANCE, CHANCE_DRAWS, chance_cells, chance_frame
from harness.reports.tables.columns import DEFAULT_METRICS
from harness.reports.tables.labels import method_labels, method_order, recorded_options
from harness.reports.tables.latex import LatexRenderer
from harness.reports.tables.layout import distinct_in_order
from harness.reports.tables.load import load_runs, select_report
from harness.reports.tables.markdown import MarkdownRenderer
from harness.reports.tables.notes import (
    code_notes,
    paper_deviation_notes,
    published_notes,
    run_deviations,
    selection_notes,
    setting_notes,
    variant_notes,
)
from harness.reports.tables.paired import (
    PerQueryLoader,
    artifact_per_query,
    artifact_problem,
    missing_results,
    paired_tests,
)
from harness.reports.tables.published import (
    PublishedValues,
    attach_published,
    published_deltas,
    published_values,
)
from harness.reports.tables.render import TableContent, TableRenderer
from harness.reports.tables.summary import summarize
from harness.reports.tuning import tuning_notes

__all__ = [
    "RENDERERS",
    "TableRequest",
    "Table",
    "make_table",
    "write_atomic",
]

#: The table formats, by the name ``harness table --format`` takes.
RENDERERS: dict[str, type[TableRenderer]] = {"latex": LatexRenderer, "markdown": MarkdownRenderer}


@dataclass(frozen=True, kw_only=True)
class TableRequest:
    """What to tabulate: the runs of ``experiments`` in format ``fmt`` (:data:`RENDERERS`),
    beside the ``published`` CSV's ``tables`` (``published_rows``: ``{reproduced method:
    ["method@setting"]}``; ``published_metrics``: ``{published metric: reproduced metric}``
    where a paper defines a metric differently, DIML: ``r_precision`` ->
    ``r_precision_query_in_r``), for ``metrics`` (default: the published table's, else
    :data:`DEFAULT_METRICS`), each row tested against the ``baseline`` method's, with the
    per-query results ``per_query`` gives (None: no bootstrap) and ``resamples`` resamples."""

    experiments: tuple[str, ...]
    fmt: str = "latex"
    published: Path | None = None
    tables: tuple[str, ...] = ()
    metrics: tuple[str, ...] | None = None
    caption: str = ""
    published_rows: Mapping[str, Sequence[str]] | None = None
    baseline: str = "plain"
    published_metrics: Mapping[str, str] | None = None
    per_query: PerQueryLoader | None = artifact_per_query
    resamples: int = 10_000
    #: A tuned grid's fold report: ``separated`` or ``concatenated`` (:mod:`harness.reports.tuning`).
    report: str = "separated"
    #: The correction of the table's paired tests for multiple comparisons
    #: (:data:`harness.reports.stats.CORRECTIONS`).
    correction: str = "holm"
    #: Draws of random embeddings behind the chance row (0: no chance row).
    chance_draws: int = CHANCE_DRAWS

    def __post_init__(self):
        if self.fmt not in RENDERERS:
            raise unknown_name("table format", self.fmt, RENDERERS)
        if self.correction not in CORRECTIONS:
            raise unknown_name("correction", self.correction, CORRECTIONS)
        if self.chance_draws < 0:
            raise HarnessError(f"--chance-draws must be 0 or more, got {self.chance_draws}")

    def title(self) -> str:
        """The caption given, else which experiments (against which published tables)."""
        return self.caption or (
            f"Reproduced (experiment {', '.join(self.experiments)})"
            + (f" vs published (table {', '.join(self.tables)})" if self.tables else "")
        )


@dataclass(frozen=True)
class Table:
    """A rendered table and what it was computed from: ``text`` (LaTeX or Markdown),
    ``tests`` (:func:`~harness.reports.tables.paired.paired_tests`, the rows of the
    paired-tests table), ``labels`` (row labels by method), ``problems`` (one line per
    run whose results a cell needed and did not get: run id and what is missing) and
    ``deltas`` (each run's distance to its published value,
    :func:`~harness.reports.tables.published.published_deltas`)."""

    text: str
    tests: pd.DataFrame
    labels: dict[str, str]
    metrics: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    deltas: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


def make_table(request: TableRequest, runs: pd.DataFrame | None = None) -> Table:
    """``runs`` (default: :func:`~harness.reports.tables.load.load_runs` of the request's
    experiments) -> :class:`Table`. Each run whose per-query results a paired bootstrap
    needed and did not get is one line on stderr (and in ``problems``)."""
    runs = select_report(load_runs(request.experiments) if runs is None else runs, request.report)
    published = published_values(
        request.published, request.tables, request.published_rows, request.published_metrics
    )
    metrics = _metrics(request, published)
    values = (
        None
        if published.values is None
        else published.values[published.values["metric"].isin(metrics)]
    )
    cells = attach_published(summarize(runs, metrics), values)
    chance = chance_frame(runs, metrics, request.per_query, draws=request.chance_draws)
    cells = chance_cells(cells, chance)
    tests = paired_tests(
        runs,
        metrics,
        baseline=request.baseline,
        per_query=request.per_query,
        resamples=request.resamples,
    )
    problems = _report_problems(runs, tests, request.per_query)
    labels = method_labels(
        sorted(set(cells["method"].dropna()) - {CHANCE} | {request.baseline}),
        recorded_options(runs),
    )
    content = TableContent(
        cells,
        metrics=metrics,
        caption=request.title(),
        deviations=run_deviations(runs),
        tests=tests,
        notes=_notes(request, runs, cells, metrics, published),
        labels=labels,
        baseline=request.baseline,
        correction=request.correction,
        chance=chance,
    )
    renderer = RENDERERS[request.fmt]()
    text = renderer.render(content) + renderer.deviations_block(paper_deviation_notes(runs))
    return Table(
        text=text,
        tests=content.ordered_tests(),
        labels=content.row_labels(),
        metrics=tuple(metrics),
        problems=tuple(problems),
        deltas=published_deltas(runs, values, metrics),
    )


def _metrics(request: TableRequest, published: PublishedValues) -> list[str]:
    if request.metrics:
        return list(request.metrics)
    return (
        distinct_in_order(published.values["metric"])
        if published.values is not None
        else list(DEFAULT_METRICS)
    )


def _report_problems(
    runs: pd.DataFrame, tests: pd.DataFrame, per_query: PerQueryLoader | None
) -> list[str]:
    """The runs a bootstrap needed and did not get, each one line on stderr too."""
    explain = artifact_problem if per_query is artifact_per_query else None
    problems = missing_results(runs, tests, explain=explain)
    for line in problems:
        print(f"tables: {line}", file=sys.stderr)
    return problems


def _notes(
    request: TableRequest,
    runs: pd.DataFrame,
    cells: pd.DataFrame,
    metrics: Sequence[str],
    published: PublishedValues,
) -> list[str]:
    """The table's notes in print order."""
    return [
        *selection_notes(runs, request.published),
        *variant_notes(metrics, dict(request.published_metrics or {})),
        *code_notes(runs),
        *setting_notes(cells),
        *tuning_notes(runs, method_order(request.baseline)),
        *published_notes(published.excluded, published.flagged),
    ]


def write_atomic(path: Path, text: str) -> None:
    """Write a table atomically (see :mod:`harness.base.atomic`)."""
    atomic_write_text(path, text)
