"""``explain-table``'s arguments: the experiments and the output."""

from __future__ import annotations

import argparse

from harness.cli.arguments import (
    at_least,
    experiment_name,
    file_name,
)
from harness.cli.explain_table import cmd_explain_table
from harness.cli.outputs import add_force_argument, add_output_argument

__all__ = ["add_explain_table_parser"]


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
    p.add_argument(
        "--name",
        type=file_name,
        help="name for the default output path (default: the experiments)",
    )
    p.add_argument("--caption")
    p.add_argument(
        "--strip",
        action="store_true",
        help="also draw one near-miss pair explained by every method's run of its first "
        "seed (<out>.strip.png; loads each run's weights)",
    )
    p.add_argument(
        "--strip-pair",
        type=at_least(0),
        default=0,
        metavar="K",
        help="which of explain's near-miss pairs the strip shows (default 0, the first)",
    )
    p.set_defaults(func=cmd_explain_table)
    return p
