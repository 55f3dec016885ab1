"""The JSON Schema of protocol and grid files: generated from the declared types and the
method registry, printed by ``python -m harness schema``, and published in docs/ (written
there by ``nox -s docs``). The published copy lists the options of the methods registered
when it was written and accepts any table for others, so a new plugin leaves it valid."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.cli.schema import schema_text
from methods import METHODS

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("kind", ["protocol", "grid"])
def test_the_schema_command_prints_the_generated_schema_as_stable_json(kind, capsys):
    text = schema_text(kind)
    assert text == schema_text(kind) and json.dumps(json.loads(text), indent=2) + "\n" == text
    assert main(["schema", kind]) == 0
    assert capsys.readouterr().out == text


def without_method_options(schema: dict) -> dict:
    """The schema less the per-method option tables (which follow the registry)."""
    out = copy.deepcopy(schema)
    out.get("properties", {}).get("methods", {}).pop("properties", None)
    return out


@pytest.mark.parametrize("kind", ["protocol", "grid"])
def test_the_published_copy_is_the_generated_schema_up_to_registered_methods(kind):
    published = json.loads((DOCS / f"{kind}.schema.json").read_text(encoding="utf-8"))
    assert without_method_options(published) == without_method_options(json.loads(schema_text(kind))), (
        f"docs/{kind}.schema.json is stale: nox -s docs (or python -m harness schema {kind} > docs/{kind}.schema.json)")


def test_the_protocol_schema_accepts_a_table_for_a_method_it_does_not_list():
    methods = json.loads(schema_text("protocol"))["properties"]["methods"]
    assert methods["additionalProperties"]["type"] == "object"


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
