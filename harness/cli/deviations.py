"""``python -m harness deviations``: where a grid's or a protocol's runs depart from the papers.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.deviations_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_deviations"]


def cmd_deviations(args: argparse.Namespace) -> int:
    """List, check or measure the deviations of ``args``
    (:func:`harness.cli.deviations_command.cmd_deviations`)."""
    # deferred: the plugins, torch and the engine load only when the command runs
    from harness.cli import deviations_command

    return deviations_command.cmd_deviations(args)
