"""The JSON Schema of protocol and grid files: generated from the declared types and the
method registry, printed by ``python -m harness schema``, and published in docs/ (written
there by ``nox -s docs``). The published copy lists the options of the methods registered
when it was written and accepts any table for others, so a new plugin leaves it valid."""

from __future__ import annotations

import copy
import json
import operator
import tomllib
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.cli.schema_command import schema_text
from harness.methods import METHODS

DOCS = Path(__file__).resolve().parents[2] / "docs"


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
    assert without_method_options(published) == without_method_options(
        json.loads(schema_text(kind))
    ), (
        f"docs/{kind}.schema.json is stale: nox -s docs (or python -m harness schema {kind} > docs/{kind}.schema.json)"
    )


def test_the_published_protocol_schema_is_the_schema_command_for_every_method_it_lists():
    """Each method the published copy lists has the options ``harness schema`` prints for it
    (a method option added to the code, and not published, fails here)."""
    published = json.loads((DOCS / "protocol.schema.json").read_text(encoding="utf-8"))
    generated = json.loads(schema_text("protocol"))
    listed = published["properties"]["methods"]["properties"]
    options = generated["properties"]["methods"]["properties"]
    assert listed, "the published copy lists no method"
    stale = sorted(m for m in listed if listed[m] != options.get(m))
    assert not stale, f"docs/protocol.schema.json is stale for {stale}: nox -s docs"


_KINDS = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
    "integer": int,
    "number": (int, float),
}
_BOUNDS = {
    "minimum": operator.ge,
    "maximum": operator.le,
    "exclusiveMinimum": operator.gt,
    "exclusiveMaximum": operator.lt,
    "minItems": operator.ge,
    "maxItems": operator.le,
}


def schema_errors(value, node: dict, defs: dict, where: str = "") -> list[str]:
    """Where ``value`` breaks the JSON Schema ``node``, for the keywords the harness's
    schemas use (``type``, ``properties``, ``additionalProperties``, ``required``,
    ``items``, ``anyOf``, ``enum``, ``const``, bounds, ``$ref``)."""
    while "$ref" in node:
        node = {
            **defs[node["$ref"].rsplit("/", 1)[-1]],
            **{k: v for k, v in node.items() if k != "$ref"},
        }
    if "anyOf" in node:
        return (
            []
            if any(not schema_errors(value, option, defs) for option in node["anyOf"])
            else [where]
        )
    own = _value_errors(value, node, where)
    if own:
        return own
    errors = []
    if isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            errors += schema_errors(item, node["items"], defs, f"{where}[{i}]")
    if isinstance(value, dict):
        errors += _member_errors(value, node, defs, where)
    return errors


def _value_errors(value, node: dict, where: str) -> list[str]:
    """The value's own breaks of ``node``: its type, its allowed values, its bounds."""
    kind = node.get("type")
    if kind and (
        not isinstance(value, _KINDS[kind])
        or (kind in ("integer", "number") and isinstance(value, bool))
    ):
        return [f"{where}: not {kind}"]
    if ("enum" in node and value not in node["enum"]) or (
        "const" in node and value != node["const"]
    ):
        return [f"{where}: {value!r} not allowed"]
    for key, holds in _BOUNDS.items():
        if key in node and not holds(len(value) if key.endswith("Items") else value, node[key]):
            return [f"{where}: {key} {node[key]}"]
    return []


def _member_errors(value: dict, node: dict, defs: dict, where: str) -> list[str]:
    """An object's breaks: required keys missing, unknown keys, and its members' own."""
    errors = [f"{where}.{key}: missing" for key in node.get("required", []) if key not in value]
    extra = node.get("additionalProperties", True)
    for key, item in value.items():
        child = node.get("properties", {}).get(key, extra)
        if child is False:
            errors.append(f"{where}.{key}: unknown key")
        elif isinstance(child, dict):
            errors += schema_errors(item, child, defs, f"{where}.{key}")
    return errors


ROOT = DOCS.parent
FILES = {
    "protocol": sorted(
        [*(ROOT / "protocols").glob("*.toml"), *(ROOT / "tests" / "protocols").glob("*.toml")]
    ),
    "grid": sorted(
        [*(ROOT / "protocols" / "grids").glob("*.toml"), *(ROOT / "tests" / "grids").glob("*.toml")]
    ),
}


@pytest.mark.parametrize(
    "kind, path",
    [(kind, path) for kind, paths in FILES.items() for path in paths],
    ids=lambda p: p.name if isinstance(p, Path) else p,
)
def test_the_generated_schema_accepts_every_file_the_harness_reads(kind, path):
    """The round trip: the schema generated from the declared types and the registry
    accepts every protocol and grid the harness ships, and refuses an unknown key in it."""
    schema = json.loads(schema_text(kind))
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    assert schema_errors(data, schema, schema["$defs"]) == []
    assert schema_errors({**data, "no_such_key": 1}, schema, schema["$defs"]) == [
        ".no_such_key: unknown key"
    ]


@pytest.mark.parametrize(
    "kind, data, error",
    [
        ("protocol", {"optimizer": {"lr_head": -1.0}}, ".optimizer.lr_head: exclusiveMinimum 0"),
        (
            "protocol",
            {"methods": {"agrouping": {"groups": "4"}}},
            ".methods.agrouping.groups: not integer",
        ),
        (
            "grid",
            {
                "protocol": "smoke",
                "methods": "every",
                "losses": ["margin"],
                "backbones": ["resnet50"],
                "datasets": ["cub200"],
                "seeds": [0],
            },
            ".methods",
        ),
        (
            "grid",
            {
                "protocol": "smoke",
                "methods": "all",
                "losses": ["margin"],
                "backbones": ["resnet50"],
                "datasets": ["cub200"],
            },
            ".seeds: missing",
        ),
    ],
)
def test_the_generated_schema_refuses_a_bad_value(kind, data, error):
    schema = json.loads(schema_text(kind))
    assert schema_errors(data, schema, schema["$defs"]) == [error]


def test_the_protocol_schema_accepts_a_table_for_a_method_it_does_not_list():
    methods = json.loads(schema_text("protocol"))["properties"]["methods"]
    assert methods["additionalProperties"]["type"] == "object"


def test_the_protocol_schema_declares_ranges_finiteness_and_method_options():
    schema = json.loads(schema_text("protocol"))
    optimizer = schema["$defs"]["OptimizerSpec"]["properties"]
    assert optimizer["lr_head"] == {
        "default": 1e-05,
        "exclusiveMinimum": 0,
        "title": "Lr Head",
        "type": "number",
    }
    assert optimizer["weight_decay"]["minimum"] == 0
    assert schema["$defs"]["SelectionSpec"]["properties"]["evaluate_every"]["minimum"] == 1
    assert schema["$defs"]["OptimizerSpec"]["additionalProperties"] is False
    options = schema["properties"]["methods"]["properties"]
    assert sorted(options) == sorted(METHODS.list())
    assert options["agrouping"]["properties"]["groups"]["type"] == "integer"
    assert options["agrouping"]["additionalProperties"] is False
    margin = schema["$defs"]["LossSpec"]["properties"]["args"]["additionalProperties"][
        "properties"
    ]["margin"]
    assert {"type": "number"} in margin["anyOf"]  # any finite margin: MLRC's searches reach -0.2
    alpha = schema["$defs"]["LossSpec"]["properties"]["args"]["additionalProperties"]["properties"][
        "alpha"
    ]
    assert {"type": "number", "exclusiveMinimum": 0} in alpha["anyOf"]


@pytest.mark.parametrize("method", METHODS.list())
def test_every_plugin_declares_option_types_its_defaults_satisfy(method):
    """The schema of a method's options comes from its constructor: each default (or a
    variant's preset) must be a value of the declared type."""
    from harness.config.options import check_option_values, options_model

    entry = METHODS.get(method)
    check_option_values(method, entry.options())
    assert set(options_model(method).model_fields) == set(entry.options())
