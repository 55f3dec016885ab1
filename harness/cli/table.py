"""``python -m harness table``: a paper-style table from finished runs.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.table_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_table"]


def cmd_table(args: argparse.Namespace) -> int:
    """Write the table of the experiments of ``args``
    (:func:`harness.cli.table_command.cmd_table`)."""
    # deferred: torch, MLflow, pandas and the reports load only when the command runs
    from harness.cli import table_command

    return table_command.cmd_table(args)
