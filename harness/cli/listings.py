"""``python -m harness datasets`` and ``methods``: what is found locally and what is registered.

The module imports nothing heavy, so that ``--help`` answers at once: ``datasets``'s work
is :mod:`harness.cli.listings_command`, and ``methods`` imports the plugins' registry,
each when its command runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_datasets", "cmd_methods"]


def cmd_datasets(args: argparse.Namespace) -> int:
    """List the datasets: found or not, where, verified or not
    (:func:`harness.cli.listings_command.cmd_datasets`)."""
    # deferred: numpy, scipy and the datasets' loaders load only when the command runs
    from harness.cli import listings_command

    return listings_command.cmd_datasets(args)


def cmd_methods(args: argparse.Namespace) -> int:
    """Each registered method plugin: its name and description, then its paper (or
    ``harness baseline``) and its options with their defaults. Listing the options
    imports the plugins, and with them torch."""
    # deferred: the plugins and torch, which they build on, load only when the command runs
    from harness.methods import METHODS

    for name in METHODS:
        entry = METHODS.get(name)
        paper = entry.cls.paper
        source = f"{paper.title} ({paper.year})" if paper else "harness baseline"
        print(
            f"{name:14s} {entry.description}\n{'':14s} {source}; options: "
            f"{', '.join(f'{k}={v!r}' for k, v in entry.options().items()) or 'none'}"
        )
    return 0
