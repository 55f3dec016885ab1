"""``python -m harness explain-table --experiment NAME``: the arguments, and the table
written as Markdown and LaTeX (:mod:`harness.reports.explanation_table`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.base.atomic import atomic_write_set
from harness.cli.arguments import experiment_name
from harness.cli.outputs import add_force_argument, add_output_argument, output_stem
from harness.cli.store import open_store
from harness.reports.explanation_table import explain_rows, latex_table, markdown_table

__all__ = ["add_explain_table_parser", "cmd_explain_table"]


def cmd_explain_table(args: argparse.Namespace) -> int:
    name = args.name or "-".join(args.experiment)
    stem = output_stem(
        args.out or Path("results") / "tables" / f"explain-{name}",
        "--out",
        (".md", ".tex"),
        args=args,
    )
    open_store(read_only=True)
    rows = explain_rows(args.experiment)
    caption = args.caption or (
        f"Explanation scores ({', '.join(args.experiment)}): mean $\\pm$ half the 95\\% "
        f"interval over pairs; chance = the differing part's area share"
    )
    markdown = markdown_table(rows)
    atomic_write_set(  # both, or neither
        {Path(f"{stem}.md"): markdown, Path(f"{stem}.tex"): latex_table(rows, caption)}
    )
    print(markdown, end="")
    print(f"wrote {stem}.md and {stem}.tex", file=sys.stderr)
    return 0


def add_explain_table_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "explain-table",
        help="table of explanation scores across methods (Markdown and "
        "LaTeX) from the explain/* metrics of the runs",
    )
    p.add_argument(
        "--experiment",
        action="append",
        required=True,
        type=experiment_name,
        help="MLflow experiment (repeat for several)",
    )
    add_output_argument(
        p,
        "--out",
        form="stem",
        help="output path without suffix (default results/tables/explain-<name>)",
    )
    add_force_argument(p)
    p.add_argument("--name", help="name for the default output path (default: the experiments)")
    p.add_argument("--caption")
    p.set_defaults(func=cmd_explain_table)
    return p
