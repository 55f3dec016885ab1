"""``explain-table``'s arguments: the experiments and the output."""

from __future__ import annotations

import argparse

from harness.cli.arguments import (
    Command,
    experiment_name,
)
from harness.cli.outputs import add_force_argument, add_output_argument


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
    p.set_defaults(func=Command("harness.cli.explain_table", "cmd_explain_table"))
    return p
