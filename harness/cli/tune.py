"""``python -m harness tune``: Optuna's search over a method's space, then the best setting over the seeds.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.tune_command`, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["cmd_tune"]


def cmd_tune(args: argparse.Namespace, *, train: Any = None) -> int:
    """Tune the method of ``args`` and reproduce its best trial
    (:func:`harness.cli.tune_command.cmd_tune`); ``train`` stands in for the engine's
    training of one run."""
    # deferred: torch, the engine, Optuna and MLflow load only when the command runs
    from harness.cli import tune_command

    return tune_command.cmd_tune(args, train=train)
