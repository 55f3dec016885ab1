"""``schema``'s arguments: which files' JSON Schema."""

from __future__ import annotations

import argparse

from harness.cli.arguments import (
    Command,
)

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
    schema.set_defaults(func=Command("harness.cli.schema", "cmd_schema"))
    return schema
