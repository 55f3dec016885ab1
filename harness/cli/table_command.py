"""``python -m harness table --experiment NAME``: the table's arguments; the table itself
is :func:`harness.reports.tables.make_table`'s, the forest plot beside it
:func:`harness.reports.figures.write_forest`'s."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.base.errors import HarnessError, unknown_name
from harness.base.paths import read_text, readable_file
from harness.base.written import write_outputs
from harness.cli.arguments import default_file_name
from harness.cli.outputs import output_file
from harness.cli.store import open_store
from harness.components.evaluation import parse_metrics
from harness.methods import METHODS
from harness.reports.figures import forest_files, forest_paths
from harness.reports.tables import (
    TableRequest,
    make_table,
    parse_published_row,
)
from harness.reports.tables.load import load_runs, select_report
from harness.reports.tuning import tuned_table_files, tuned_table_paths
from harness.store.tables import record_table_set

__all__ = ["cmd_table"]


def cmd_table(args: argparse.Namespace) -> int:
    request = _request(args)
    name = args.name or default_file_name(args.experiment, "+")
    suffix = ".tex" if args.format == "latex" else ".md"
    out = output_file(
        args.out or Path("results") / "tables" / f"{name}{suffix}", "--out", args=args
    )
    stem = out.with_suffix("")
    for flag, paths in (
        ("--out (forest plot)", forest_paths(stem)),
        ("--out (tuned table's appendix and figure)", tuned_table_paths(stem, args.format)),
    ):  # every file the table may get beside it
        for path in paths:
            output_file(path, flag, args=args)
    open_store(read_only=True)
    table = make_table(request)
    if args.strict and table.problems:
        raise HarnessError(
            f"--strict: {len(table.problems)} run(s) lack results the table needs "
            f"(listed above); nothing written"
        )
    figures = forest_files(out.with_suffix(""), table.tests, table.labels, metrics=table.metrics)
    # A tuned grid's table: its appendix of chosen settings and its best-so-far figure too.
    tuned = tuned_table_files(
        select_report(load_runs(args.experiment), args.report), out.with_suffix(""), args.format
    )
    figures = {**figures, **tuned}
    write_outputs({out: table.text, **figures})  # the table and its figures, or none
    print(table.text)
    print(
        f"written to {out}"
        + (f"; beside it {', '.join(p.name for p in figures)}" if figures else ""),
        file=sys.stderr,
    )
    record_table_set(request.experiments, stem.name, [out, *figures], table.deltas)
    print(
        f"logged to the tracking store: run '{stem.name}' of experiment "
        f"{', '.join(request.experiments)} holds the table set"
        + (f"; {len(table.deltas)} run(s) got delta/* metrics" if table.deltas else ""),
        file=sys.stderr,
    )
    return 0


def _request(args: argparse.Namespace) -> TableRequest:
    """The table the arguments ask for, each argument checked (a flag that needs
    ``--published`` without it, a misspelt metric or baseline is refused)."""
    tables = [t.strip() for t in (args.table or "").split(",") if t.strip()]
    if tables and not args.published:
        raise HarnessError("--table needs --published (the CSV the table number refers to)")
    metrics = _metrics(args.metrics)
    rows: dict[str, list[str]] = {}
    for reproduced, spec in _pairs(
        args.published_row, "--published-row", "METHOD=PUBLISHED_METHOD@SETTING"
    ):
        parse_published_row(spec)
        rows.setdefault(reproduced, []).append(spec)
    if rows and not args.published:
        raise HarnessError("--published-row needs --published (the CSV the rows are in)")
    _check_baseline(args.baseline)
    if readable_file(args.published, "--published"):
        read_text(args.published, "CSV")
    metric_map = dict(
        _pairs(args.published_metric, "--published-metric", "PUBLISHED_METRIC=REPRODUCED_METRIC")
    )
    if metric_map and not args.published:
        raise HarnessError("--published-metric needs --published (the CSV whose metric it renames)")
    return TableRequest(
        experiments=tuple(args.experiment),
        fmt=args.format,
        published=args.published,
        tables=tuple(tables),
        metrics=tuple(metrics) if metrics else None,
        caption=args.caption or "",
        published_rows=rows or None,
        baseline=args.baseline,
        published_metrics=metric_map or None,
        report=args.report,
        correction=args.correction,
        chance_draws=args.chance_draws,
    )


def _metrics(text: str | None) -> list[str] | None:
    """``--metrics``, each name checked: a misspelt metric is refused, not left out of the
    table (a published spread, ``recall_at_1_std``, is its metric's)."""
    metrics = [m.strip() for m in text.split(",")] if text else None
    if metrics:
        try:
            parse_metrics(m.removesuffix("_std") for m in metrics)
        except HarnessError as err:
            raise HarnessError(f"--metrics: {err}") from None
    return metrics


def _check_baseline(name: str) -> None:
    """The baseline must be a registered method (a misspelt one would compare nothing)."""

    if name not in METHODS:
        raise unknown_name("--baseline method", name, METHODS)


def _pairs(items: Sequence[str] | None, flag: str, shape: str) -> list[tuple[str, str]]:
    out = []
    for item in items or []:
        left, sep, right = item.partition("=")
        if not sep or not left.strip() or not right.strip():
            raise HarnessError(f"{flag} '{item}' must look like {shape}")
        out.append((left.strip(), right.strip()))
    return out
