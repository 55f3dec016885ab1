"""``python -m harness env RUN_ID``: the environment a run recorded, as pip constraints.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.env_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_env"]


def cmd_env(args: argparse.Namespace) -> int:
    """Print or write the constraints of a run's environment
    (:func:`harness.cli.env_command.cmd_env`)."""
    # deferred: MLflow and torch load only when the command runs
    from harness.cli import env_command

    return env_command.cmd_env(args)
