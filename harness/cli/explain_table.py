"""``python -m harness explain-table --experiment NAME``: the arguments, and the table
written as Markdown and LaTeX (:mod:`harness.reports.explanation_table`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.base.atomic import atomic_write_set
from harness.cli.outputs import output_stem
from harness.cli.store import open_store
from harness.reports.explanation_table import explain_rows, latex_table, markdown_table

__all__ = ["cmd_explain_table"]


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
