"""``python -m harness datasets fetch`` and ``datasets verify``: a benchmark downloaded,
verified and unpacked; a dataset's images decoded once.

The module imports nothing heavy, so that ``--help`` answers at once; the command's
work, and what it loads, is :mod:`harness.cli.fetch_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_fetch", "cmd_verify"]


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download (or read), verify and unpack the benchmark of ``args``
    (:func:`harness.cli.fetch_command.cmd_fetch`)."""
    # deferred: numpy, scipy and the datasets' loaders load only when the command runs
    from harness.cli import fetch_command

    return fetch_command.cmd_fetch(args)


def cmd_verify(args: argparse.Namespace) -> int:
    """Decode every image of the dataset of ``args`` once
    (:func:`harness.cli.fetch_command.cmd_verify`)."""
    # deferred: numpy, scipy and the datasets' loaders load only when the command runs
    from harness.cli import fetch_command

    return fetch_command.cmd_verify(args)
