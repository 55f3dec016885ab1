"""``python -m harness explain-table``: the explanation scores of several methods as one table.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.explain_table_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_explain_table"]


def cmd_explain_table(args: argparse.Namespace) -> int:
    """Write the explanation table of the experiments of ``args``
    (:func:`harness.cli.explain_table_command.cmd_explain_table`)."""
    # deferred: torch, MLflow and the reports load only when the command runs
    from harness.cli import explain_table_command

    return explain_table_command.cmd_explain_table(args)
