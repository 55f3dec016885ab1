"""``python -m harness deviations``: where a grid's or a protocol's runs depart from the papers.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.deviations_command`, imported when it runs."""

from __future__ import annotations

import argparse

from harness.config.catalog import MAX_CELLS, list_grids

__all__ = ["add_deviations_parser", "cmd_deviations"]


def cmd_deviations(args: argparse.Namespace) -> int:
    """List, check or measure the deviations of ``args``
    (:func:`harness.cli.deviations_command.cmd_deviations`)."""
    # deferred: the plugins, torch and the engine load only when the command runs
    from harness.cli import deviations_command

    return deviations_command.cmd_deviations(args)


def add_deviations_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "deviations",
        help="list where a grid's or protocol's runs depart from the paper and the authors' code",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--grid", help=f"a grid name or .toml path ({', '.join(list_grids())})")
    which.add_argument(
        "--protocol", help="a protocol name or .toml path (default: every shipped protocol)"
    )
    p.add_argument("--smoke", action="store_true", help="with --grid: the grid's smoke version")
    p.add_argument(
        "--name", help="show one deviation by name (with --measure: measure that one alone)"
    )
    p.add_argument(
        "--ledger",
        help="with --grid: check this recipe ledger (a name under protocols/ledgers or a "
        ".toml path) against the grid, instead of the ledgers that cover it",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="with --grid: run each deviation switched to the authors' value (its ledger's "
        "entries) against the grid's value on the grid's smoke version, and print the "
        "paired differences in P@1 and MAP@R with their 95%% intervals",
    )
    p.add_argument(
        "--seeds",
        default="0,1,2",
        help="with --measure: the seeds of each pair of runs (default 0,1,2)",
    )
    p.add_argument("--device", default="auto", help="with --measure: auto, cpu or cuda")
    p.add_argument("--data-root", help="with --measure: where datasets are looked for")
    p.add_argument(
        "--yes",
        action="store_true",
        help=f"with --grid: expand a grid of more than {MAX_CELLS:,} cells (refused without it)",
    )
    p.set_defaults(func=cmd_deviations)
    return p
