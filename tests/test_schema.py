"""The published JSON Schema of protocol and grid files: what the harness validates with,
committed in docs/ up to date, and printed by ``python -m harness schema``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.cli.schema import schema_text
from methods import METHODS

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("kind", ["protocol", "grid"])
def test_the_committed_schema_is_the_one_the_harness_validates_with(kind, capsys):
    committed = (DOCS / f"{kind}.schema.json").read_text(encoding="utf-8")
    assert committed == schema_text(kind), (
        f"docs/{kind}.schema.json is stale: python -m harness schema {kind} > docs/{kind}.schema.json")
    assert main(["schema", kind]) == 0
    assert capsys.readouterr().out == committed


def test_the_protocol_schema_declares_ranges_finiteness_and_method_options():
    schema = json.loads(schema_text("protocol"))
    optimizer = schema["$defs"]["OptimizerSpec"]["properties"]
    assert optimizer["lr_head"] == {"default": 1e-05, "exclusiveMinimum": 0, "title": "Lr Head", "type": "number"}
    assert optimizer["weight_decay"]["minimum"] == 0
    assert schema["$defs"]["SelectionSpec"]["properties"]["evaluate_every"]["minimum"] == 1
    assert schema["$defs"]["OptimizerSpec"]["additionalProperties"] is False
    options = schema["properties"]["methods"]["properties"]
    assert sorted(options) == sorted(METHODS.list())
    assert options["agrouping"]["properties"]["groups"]["type"] == "integer"
    assert options["agrouping"]["additionalProperties"] is False
    margin = schema["$defs"]["LossSpec"]["properties"]["args"]["additionalProperties"]["properties"]["margin"]
    assert {"type": "number", "minimum": 0} in margin["anyOf"]


@pytest.mark.parametrize("method", METHODS.list())
def test_every_plugin_declares_option_types_its_defaults_satisfy(method):
    """The schema of a method's options comes from its constructor: each default (or a
    variant's preset) must be a value of the declared type."""
    from harness.config.options import check_option_values, options_model

    entry = METHODS.get(method)
    check_option_values(method, entry.options())
    assert set(options_model(method).model_fields) == set(entry.options())
