"""``python -m harness schema``: the JSON Schema of protocol or grid files.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.schema_command`, imported when it runs."""

from __future__ import annotations

import argparse

__all__ = ["add_schema_parser", "KINDS", "cmd_schema"]


def cmd_schema(args: argparse.Namespace) -> int:
    """Print the JSON Schema of ``args.kind``
    (:func:`harness.cli.schema_command.cmd_schema`)."""
    # deferred: the plugins and torch (the schema names their options) load only when the command runs
    from harness.cli import schema_command

    return schema_command.cmd_schema(args)


#: The kinds of file with a JSON Schema.
KINDS = ("protocol", "grid")


def add_schema_parser(subparsers) -> argparse.ArgumentParser:
    schema = subparsers.add_parser(
        "schema", help="print the JSON Schema of protocol (or grid) files"
    )
    schema.add_argument(
        "kind",
        nargs="?",
        choices=KINDS,
        default="protocol",
        help="which files: protocol (default) or grid",
    )
    schema.set_defaults(func=cmd_schema)
    return schema
