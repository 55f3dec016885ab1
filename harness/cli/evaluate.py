"""``python -m harness evaluate``: score saved embeddings with the evaluation suite.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.evaluate_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_evaluate"]


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Score the saved embeddings of ``args``
    (:func:`harness.cli.evaluate_command.cmd_evaluate`)."""
    # deferred: torch, numpy and faiss load only when the command runs
    from harness.cli import evaluate_command

    return evaluate_command.cmd_evaluate(args)
