"""``python -m harness explain-table``: the explanation scores of several methods as one table.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.explain_table_command`, imported when it runs."""

from __future__ import annotations

import argparse

from harness.cli.arguments import (
    at_least,
    experiment_name,
    file_name,
)
from harness.cli.outputs import add_force_argument, add_output_argument

__all__ = ["add_explain_table_parser", "cmd_explain_table"]


def cmd_explain_table(args: argparse.Namespace) -> int:
    """Write the explanation table of the experiments of ``args``
    (:func:`harness.cli.explain_table_command.cmd_explain_table`)."""
    # deferred: torch, MLflow and the reports load only when the command runs
    from harness.cli import explain_table_command

    return explain_table_command.cmd_explain_table(args)


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
