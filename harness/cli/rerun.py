"""``python -m harness rerun``: runs trained again from their records, every metric compared.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.rerun_command`, imported when it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["cmd_rerun"]


def cmd_rerun(
    args: argparse.Namespace, *, train: Callable[..., dict[str, Any]] | None = None
) -> int:
    """Re-run the runs of ``args`` and compare their metrics
    (:func:`harness.cli.rerun_command.cmd_rerun`); ``train`` stands in for the engine's
    training of one run."""
    # deferred: torch, the engine and MLflow load only when the command runs
    from harness.cli import rerun_command

    return rerun_command.cmd_rerun(args, train=train)
