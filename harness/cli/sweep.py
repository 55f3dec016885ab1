"""``python -m harness sweep``: every cell of a grid once, restartable, by any number of workers.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.sweep_command`, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["cmd_sweep"]


def cmd_sweep(args: argparse.Namespace, *, train: Any = None, submitter: Any = None) -> int:
    """Sweep, show or cancel the grid of ``args``
    (:func:`harness.cli.sweep_command.cmd_sweep`); ``train`` and ``submitter`` stand in
    for the engine's training and the cluster's job submission."""
    # deferred: torch, the engine, Optuna and MLflow load only when the command runs
    from harness.cli import sweep_command

    return sweep_command.cmd_sweep(args, train=train, submitter=submitter)
