"""``python -m harness run``: train and evaluate methods under a fair protocol.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.run_command`, imported when it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["cmd_run"]


def cmd_run(
    args: argparse.Namespace,
    *,
    train: Callable[..., dict[str, Any]] | None = None,
    estimate: Callable[..., Any] | None = None,
) -> int:
    """Train and test the methods of ``args``, seed by seed
    (:func:`harness.cli.run_command.cmd_run`); ``train`` stands in for the engine's
    training of one run, ``estimate`` for the estimate made before the first."""
    # deferred: torch, the engine and MLflow load only when the command runs
    from harness.cli import run_command

    return run_command.cmd_run(args, train=train, estimate=estimate)
