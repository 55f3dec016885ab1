"""``python -m harness export RUN_ID DIR``: a run's trained embedder as an MLflow model
folder of its own, loaded with MLflow and torch alone.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.export_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_export"]


def cmd_export(args: argparse.Namespace) -> int:
    """Write the model folder of ``args.run_id`` (:func:`harness.cli.export_command.cmd_export`)."""
    # deferred: torch, the engine and MLflow load only when the command runs
    from harness.cli import export_command

    return export_command.cmd_export(args)
