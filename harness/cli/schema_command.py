"""``python -m harness schema``: the JSON Schema of protocol or grid files, for editors
that check TOML against one (taplo, Even Better TOML: a ``#:schema`` line at the top of
the file). The same declared types validate every file the harness reads."""

from __future__ import annotations

import argparse
import json

from harness.config.grids import grid_json_schema
from harness.config.protocol import protocol_json_schema

__all__ = ["cmd_schema", "schema_text"]


def schema_text(kind: str) -> str:
    """The JSON Schema of ``kind`` files as the text ``docs/<kind>.schema.json`` holds."""

    schema = protocol_json_schema() if kind == "protocol" else grid_json_schema()
    return json.dumps(schema, indent=2) + "\n"


def cmd_schema(args: argparse.Namespace) -> int:
    print(schema_text(args.kind), end="")
    return 0
