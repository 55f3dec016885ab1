"""The declared schema of the harness's input files: the field types every protocol, grid
and method-options table is validated against (pydantic), and the one ``error:`` line a
refused value becomes.

Scalars are strict (``"3"`` is not a number, ``1`` is not ``true``; an integer is a
float), floats are finite (``nan`` and ``inf`` are refused everywhere) and unknown keys
are errors. A refusal names the key, the value and what is allowed, in the words of the
JSON Schema the same types export (``python -m harness schema``)::

    protocol key 'optimizer.lr_head' = nan: expected a finite number > 0
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import ConfigDict, Strict, ValidationError

from harness.base.errors import HarnessError

__all__ = [
    "SPEC_CONFIG",
    "OPTIONS_CONFIG",
    "Int",
    "Float",
    "Bool",
    "Str",
    "refusal",
    "describe",
    "shown",
]

#: The pydantic settings of every section of a protocol (set as ``__pydantic_config__``):
#: unknown keys refused, floats finite. Strictness is per scalar type (below): a strict
#: dataclass would refuse the TOML tables it is validated from.
SPEC_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
#: A method's options, validated as one strict model (its option types are plain Python ones).
OPTIONS_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

Int = Annotated[int, Strict()]
#: An integer is accepted (and stored as a float): ``lr = 1`` in a TOML file.
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


def shown(value: Any) -> str:
    """A value as the user wrote it in TOML: ``nan``, ``true``, ``"adam"``, ``[1, 2]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


_BOUNDS = (
    ("exclusiveMinimum", ">"),
    ("minimum", ">="),
    ("exclusiveMaximum", "<"),
    ("maximum", "<="),
)
#: JSON Schema type -> (one, several) in words.
_NOUNS = {
    "number": ("a finite number", "finite numbers"),
    "integer": ("an integer", "integers"),
    "boolean": ("true or false", "booleans"),
    "string": ("a string", "strings"),
    "object": ("a table", "tables"),
    "null": ("nothing (the default)", "nothing"),
}


def describe(node: dict[str, Any], defs: dict[str, Any], *, plural: bool = False) -> str:
    """What a JSON Schema node allows, in words: ``a finite number > 0``, ``an integer >= 1``,
    ``a list of 2 finite numbers``, ``one of "adam", "sgd"``."""
    node = _resolved(node, defs)
    if "anyOf" in node:  # None is the default of an optional value, never written in TOML
        options = [o for o in node["anyOf"] if o.get("type") != "null"] or node["anyOf"]
        return " or ".join(describe(option, defs, plural=plural) for option in options)
    if "enum" in node:
        return "one of " + ", ".join(shown(v) for v in node["enum"])
    if "const" in node:
        return shown(node["const"])
    kind: Any = node.get("type")
    bounds = " and".join(f" {sign} {shown(node[key])}" for key, sign in _BOUNDS if key in node)
    if kind == "array":
        low, high = node.get("minItems"), node.get("maxItems")
        count = f"{low} " if low is not None and low == high else ""
        items = describe(node["items"], defs, plural=True) if node.get("items") else "values"
        kind = "non-empty list" if low == 1 and high is None else "list"
        return f"{kind + 's' if plural else 'a ' + kind} of {count}{items}"
    one, several = _NOUNS.get(kind, ("a value", "values"))
    # A string of a given form (a Slurm time limit) is described by its examples.
    like = f" like {' or '.join(shown(e) for e in node['examples'])}" if "examples" in node else ""
    return (several if plural else one) + bounds + like


def _resolved(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = {
            **defs[node["$ref"].rsplit("/", 1)[-1]],
            **{k: v for k, v in node.items() if k != "$ref"},
        }
    return node


def _node_at(schema: dict[str, Any], loc: Sequence[str | int]) -> dict[str, Any] | None:
    """The schema node of the value at ``loc`` (keys and list indices), or None."""
    defs = schema.get("$defs", {})
    node: dict[str, Any] = schema
    for part in loc:
        node = _resolved(node, defs)
        if isinstance(part, int) and "items" in node:
            node = node["items"]
        elif isinstance(node.get("properties"), dict) and part in node["properties"]:
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def refusal(
    err: ValidationError, schema: dict[str, Any], *, what: str, prefix: Sequence[str] = ()
) -> HarnessError:
    """The first error of ``err`` as one line: ``<what> 'a.b' = <value>: expected <...>``, or
    ``unknown <what> 'a.c' (did you mean 'a.b'?)``. ``schema``: the JSON Schema of what was
    validated; ``prefix``: keys that lead to it (``methods.agrouping``) for the message."""
    first = err.errors()[0]
    # Validator and union-member tags ('function-after[...]', 'list[str]') are not keys.
    loc = [
        p
        for p in first["loc"]
        if not (isinstance(p, str) and (p.startswith("function-") or "[" in p))
    ]
    key = _dotted([*prefix, *loc])
    if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = _node_at(schema, loc[:-1]) or {}
        names = sorted(_resolved(parent, schema.get("$defs", {})).get("properties", {}))
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = (
            f" (did you mean '{close[0]}'?)"
            if close
            else f" (valid: {', '.join(names)})"
            if names
            else ""
        )
        return HarnessError(f"unknown {what} '{key}'{hint}")
    if first["type"] == "missing":
        return HarnessError(f"{what} '{key}' is missing")
    node = _node_at(schema, loc)
    expected = describe(node, schema.get("$defs", {})) if node is not None else first["msg"].lower()
    return HarnessError(f"{what} '{key}' = {shown(first['input'])}: expected {expected}")
