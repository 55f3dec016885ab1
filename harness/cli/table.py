"""``python -m harness table``: a paper-style table from finished runs.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.table_command`, imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.base.metric_keys import TABLE_METRICS
from harness.cli.arguments import (
    experiment_name,
    file_name,
)
from harness.cli.outputs import add_force_argument, add_output_argument
from harness.config.catalog import REPORTS

__all__ = ["add_table_parser", "cmd_table"]


def cmd_table(args: argparse.Namespace) -> int:
    """Write the table of the experiments of ``args``
    (:func:`harness.cli.table_command.cmd_table`)."""
    # deferred: torch, MLflow, pandas and the reports load only when the command runs
    from harness.cli import table_command

    return table_command.cmd_table(args)


def add_table_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "table", help="paper-style table (LaTeX or Markdown) from finished MLflow runs"
    )
    p.add_argument(
        "--experiment",
        action="append",
        required=True,
        type=experiment_name,
        help="MLflow experiment to read (repeat for several)",
    )
    p.add_argument("--format", choices=("latex", "markdown"), default="latex")
    add_output_argument(
        p,
        "--out",
        help="output file (default results/tables/<name>.tex|.md); the forest plot is written "
        "beside it",
    )
    add_force_argument(p)
    p.add_argument(
        "--name",
        type=file_name,
        help="table name for the default output path (default: the experiment)",
    )
    _add_published_arguments(p)
    p.add_argument(
        "--baseline",
        default="plain",
        help="method of the row every other row of a block is tested against (default plain)",
    )
    p.add_argument(
        "--metrics",
        help="comma-separated metrics (default: the published table's, "
        f"else {','.join(TABLE_METRICS)})",
    )
    p.add_argument("--caption")
    p.add_argument(
        "--report",
        choices=REPORTS,
        default="separated",
        help="a tuned grid with k > 1 folds: the mean of the fold models' metrics (separated, "
        "the default) or their concatenated embeddings' (concatenated)",
    )
    _add_verdict_arguments(p)
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail (exit 2, nothing written) when a cell cannot be computed as it should, e.g. a "
        "run's per-query results are missing; without it such cells are marked and listed on stderr",
    )
    p.set_defaults(func=cmd_table)
    return p


def _add_published_arguments(p: argparse.ArgumentParser) -> None:
    """The published numbers set beside the reproduced ones: the CSV, its tables, rows
    and metrics."""
    p.add_argument(
        "--published",
        type=Path,
        help="CSV of published numbers, e.g. results/published/agrouping.csv",
    )
    p.add_argument("--table", help="table number(s) in the published CSV, e.g. 3 or 3,4")
    p.add_argument(
        "--published-row",
        action="append",
        metavar="METHOD=PUBLISHED@SETTING",
        help="the published rows beside a reproduced method, by the CSV's method and setting "
        "columns, e.g. diablo_n16=diablo@entries=16 (repeat; an empty setting: diablo=diablo@); "
        "given, rows not named are left out",
    )
    p.add_argument(
        "--published-metric",
        action="append",
        metavar="PUBLISHED=REPRODUCED",
        help="compare a published metric with a reproduced variant defined as the paper defines it, "
        "e.g. r_precision=r_precision_query_in_r (DIML; repeat)",
    )


def _add_verdict_arguments(p: argparse.ArgumentParser) -> None:
    """What the paired tests are corrected for and held against: the correction and the
    chance row's draws."""
    p.add_argument(
        "--correction",
        choices=("holm", "bh", "none"),
        default="holm",
        help="correction of the paired tests for multiple comparisons, over every p-value of "
        "the table: holm (Holm's step-down, family-wise error; the default), bh "
        "(Benjamini-Hochberg, false discovery rate) or none (for a table of one comparison)",
    )
    p.add_argument(
        "--chance-draws",
        type=int,
        default=5,
        metavar="N",
        help="draws of random embeddings behind the chance row (the same evaluation of the "
        "same test set; default 5, 0: no chance row)",
    )
