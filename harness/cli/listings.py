"""``python -m harness datasets`` (with ``datasets fetch`` and ``datasets verify``),
``methods`` and ``ui``: their arguments; what is found locally and what is registered.

The module imports nothing heavy, so that ``--help`` answers at once: ``datasets``'s work
is :mod:`harness.cli.listings_command`, imported when it runs; ``methods`` reads the
built-in plugins from a catalog (:func:`cmd_methods`)."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from harness.base.registry import METHOD_PLUGIN_GROUP, source_digest
from harness.cli.arguments import (
    positive_number,
)
from harness.cli.fetch import cmd_fetch, cmd_verify
from harness.cli.plugin_lines import package_plugin_lines
from harness.cli.ui import cmd_ui
from harness.config.method_catalog import METHOD_LINES, SOURCE_DIGEST

__all__ = [
    "add_listing_parsers",
    "add_fetch_parser",
    "add_verify_parser",
    "cmd_datasets",
    "cmd_methods",
]


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
    torch); an installed package's plugins from the lines kept when they were last read
    (:mod:`harness.cli.plugin_lines`). The registry is read where the plugins are loaded
    already, where the plugin files are not those the catalog was written from, or where a
    package's files are not those its kept lines were read from."""
    if METHODS_MODULE in sys.modules or source_digest(PLUGIN_FOLDER) != SOURCE_DIGEST:
        # deferred: the plugins and torch, which they build on, load only for a registry
        # the catalog does not hold
        from harness.methods.listing import method_lines

        lines = method_lines()
    else:
        packages = entry_points(group=METHOD_PLUGIN_GROUP)
        lines = {**METHOD_LINES, **package_plugin_lines(packages, set(METHOD_LINES))}
    print("\n".join(lines[name] for name in sorted(lines)))
    return 0


def add_listing_parsers(subparsers) -> None:
    ds = subparsers.add_parser(
        "datasets",
        help="list datasets: found or not, where, verified or not, images; "
        "'datasets fetch NAME' downloads one, 'datasets verify NAME' decodes every image",
    )
    ds.add_argument("--data-root", type=Path)
    ds.set_defaults(func=cmd_datasets)
    commands = ds.add_subparsers(dest="datasets_command", metavar="{fetch,verify}")
    add_fetch_parser(commands)
    add_verify_parser(commands)

    me = subparsers.add_parser("methods", help="list registered method plugins")
    me.set_defaults(func=cmd_methods)

    ui = subparsers.add_parser("ui", help="open the MLflow UI over the tracking store (127.0.0.1)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument(
        "--experiment",
        help="the experiment whose runs page is printed (and opened) first "
        "(default: the most recently active)",
    )
    ui.add_argument(
        "--open", action="store_true", help="open the first runs page in the default web browser"
    )
    ui.set_defaults(func=cmd_ui)


def add_fetch_parser(dataset_commands) -> None:
    fetch = dataset_commands.add_parser(
        "fetch",
        help="download a benchmark, verify it and unpack it in its official layout",
        description="Download (resumably) or read with --from, verify the checksum, unpack beside the target, "
        "check the official counts, then move into place. Cars196 and In-Shop need a manual "
        "download first: the command says what to get.",
    )
    fetch.add_argument("name", help="cub200, cars196, sop or inshop")
    fetch.add_argument(
        "--data-root",
        dest="fetch_data_root",
        type=Path,
        help="default $DML_HARNESS_DATA, else ~/.cache/dml-harness",
    )
    fetch.add_argument(
        "--from",
        dest="local_files",
        type=Path,
        action="append",
        metavar="FILE",
        help="a file of the release already downloaded (repeat, in the order the dataset lists)",
    )
    fetch.add_argument("--url", help="download from this mirror instead (one-file datasets)")
    fetch.add_argument(
        "--sha256",
        action="append",
        metavar="HEX",
        help="a checksum to hold each file to, besides any published one (repeat per file)",
    )
    fetch.add_argument(
        "--timeout",
        type=positive_number,
        default=60.0,
        help="seconds a silent connection is waited for (default 60)",
    )
    fetch.set_defaults(func=cmd_fetch)


def add_verify_parser(dataset_commands) -> None:
    verify = dataset_commands.add_parser(
        "verify",
        help="decode every image of a dataset once and stamp the tree as verified",
        description="Decode every image (in threads), name any that fails, and on success leave a stamp "
        "in the dataset's folder; 'run' trusts a stamp that matches the tree (file list, sizes, "
        "modification times) and otherwise checks each image's header before training.",
    )
    verify.add_argument(
        "name",
        help="a dataset name (python -m harness datasets lists them), or your own dataset's "
        "folder or .csv file",
    )
    verify.add_argument(
        "--data-root",
        dest="verify_data_root",
        type=Path,
        metavar="DIR",
        help="default $DML_HARNESS_DATA, else ~/.cache/dml-harness",
    )
    verify.add_argument(
        "--threads",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="decoding threads (default: the CPU count, at most 8)",
    )
    verify.set_defaults(func=cmd_verify)
