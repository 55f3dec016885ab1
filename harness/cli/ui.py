"""``python -m harness ui``: the MLflow UI over the tracking store.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.ui_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_ui"]


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve the MLflow UI over the tracking store
    (:func:`harness.cli.ui_command.cmd_ui`)."""
    # deferred: MLflow and torch load only when the command runs
    from harness.cli import ui_command

    return ui_command.cmd_ui(args)
