"""``schema``'s arguments: which files' JSON Schema."""

from __future__ import annotations

import argparse

from harness.cli.schema import cmd_schema

__all__ = ["add_schema_parser", "KINDS"]


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
