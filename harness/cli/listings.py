"""``python -m harness datasets`` and ``methods``: what is found locally and what is registered.

The module imports nothing heavy, so that ``--help`` answers at once: ``datasets``'s work
is :mod:`harness.cli.listings_command`, imported when it runs; ``methods`` reads the
built-in plugins from a catalog (:func:`cmd_methods`)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from pathlib import Path

from harness.base.registry import METHOD_PLUGIN_GROUP, source_digest
from harness.config.method_catalog import METHOD_LINES, SOURCE_DIGEST

__all__ = ["cmd_datasets", "cmd_methods"]

#: The package of the method plugins, whose import registers them, and its folder.
METHODS_MODULE = "harness.methods"
PLUGIN_FOLDER = Path(__file__).resolve().parents[1] / "methods"


def cmd_datasets(args: argparse.Namespace) -> int:
    """List the datasets: found or not, where, verified or not
    (:func:`harness.cli.listings_command.cmd_datasets`)."""
    # deferred: numpy, scipy and the datasets' loaders load only when the command runs
    from harness.cli import listings_command

    return listings_command.cmd_datasets(args)


def cmd_methods(args: argparse.Namespace) -> int:
    """Each registered method plugin: its name and description, then its paper (or
    ``harness baseline``) and its options with their defaults. The built-in plugins' lines
    come from :mod:`harness.config.method_catalog`, without importing a plugin (and
    torch); the registry is read where a package installs plugins of its own or the
    plugins are loaded already, or where the plugin files are not those the catalog was
    written from."""
    if (
        METHODS_MODULE in sys.modules
        or entry_points(group=METHOD_PLUGIN_GROUP)
        or source_digest(PLUGIN_FOLDER) != SOURCE_DIGEST
    ):
        # deferred: the plugins and torch, which they build on, load only for a registry
        # the catalog does not hold
        from harness.methods.listing import method_lines

        lines = method_lines()
    else:
        lines = METHOD_LINES
    print("\n".join(lines[name] for name in sorted(lines)))
    return 0
