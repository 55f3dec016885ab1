"""``python -m harness explain-table --experiment NAME``: the arguments, and the table
written as Markdown and LaTeX (:mod:`harness.reports.explanation_table`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.base.written import write_outputs
from harness.cli.arguments import default_file_name
from harness.cli.outputs import output_stem
from harness.cli.store import open_store
from harness.engine.explain.strip import explain_strip
from harness.reports.explanation_table import (
    ExplainRow,
    explain_rows,
    latex_table,
    markdown_table,
)

__all__ = ["cmd_explain_table", "strip_runs"]


def cmd_explain_table(args: argparse.Namespace) -> int:
    name = args.name or default_file_name(args.experiment, "-")
    stem = output_stem(
        args.out or Path("results") / "tables" / f"explain-{name}",
        "--out",
        (".md", ".tex", *((".strip.png",) if args.strip else ())),
        args=args,
    )
    open_store(read_only=True)
    rows = explain_rows(args.experiment)
    caption = args.caption or (
        f"Explanation scores ({', '.join(args.experiment)}): mean $\\pm$ half the 95\\% "
        f"interval over pairs (one seed) or over seeds (several); within-object chance = the "
        f"differing part's area over the object's, chance share = its area over the image's"
    )
    markdown = markdown_table(rows)
    if args.strip:  # first: the runs' weights can be missing, and then nothing is written
        strip = explain_strip(strip_runs(rows), Path(f"{stem}.strip.png"), pair=args.strip_pair)
    write_outputs(  # both, or neither
        {Path(f"{stem}.md"): markdown, Path(f"{stem}.tex"): latex_table(rows, caption)}
    )
    print(markdown, end="")
    print(f"wrote {stem}.md and {stem}.tex", file=sys.stderr)
    if args.strip:
        print(f"wrote {strip}", file=sys.stderr)
    return 0


def strip_runs(rows: list[ExplainRow]) -> list[str]:
    """Per method, the run of its first seed, in the table's order."""
    runs: dict[str, str] = {}
    for row in rows:
        if not row.reference:
            runs.setdefault(row.method, row.run_ids[0])
    return list(runs.values())
