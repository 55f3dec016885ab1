"""``python -m harness explain``: a finished run's similarities explained and the explanations scored.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.explain_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_explain"]


def cmd_explain(args: argparse.Namespace) -> int:
    """Explain the run of ``args`` and score its maps
    (:func:`harness.cli.explain_command.cmd_explain`)."""
    # deferred: torch, the engine and MLflow load only when the command runs
    from harness.cli import explain_command

    return explain_command.cmd_explain(args)
