"""Overrides: protocol settings addressed by dotted keys (``schedule.epochs=3``).

A command line's ``--set``, a grid's ``set`` table and a protocol's own per-dataset
sections all change a protocol through these keys. Each change is recorded as a named
:class:`Deviation`; a value equal to the protocol's is not one. This module works on a
protocol's table (every field, as plain dicts and lists);
:func:`harness.config.protocol.apply_overrides` turns that table back into a validated
protocol.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass
from typing import Any

from harness.base.errors import HarnessError
from harness.components.losses import LOSSES, PML_REDUCTION
from harness.methods import METHODS

__all__ = [
    "Deviation",
    "flatten_keys",
    "jsonable",
    "parse_overrides",
    "parse_value",
    "set_dotted_keys",
]


@dataclass(frozen=True)
class Deviation:
    """A protocol field changed on the command line: named, recorded, fingerprinted."""

    field: str
    protocol_value: Any
    value: Any

    def __str__(self) -> str:
        return f"{self.field}: {self.protocol_value!r} -> {self.value!r}"


def jsonable(value: Any) -> Any:
    """``value`` as a protocol's table holds it: tuples as lists, keys as strings."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def flatten_keys(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"schedule": {"epochs": 100}}`` -> ``{"schedule.epochs": 100}`` (dicts that are
    protocol values, such as ``loss.args``, are reached key by key)."""
    out = {}
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten_keys(value, dotted))
        else:
            out[dotted] = value
    return out


def parse_value(text: str) -> Any:
    """Parse an override value with TOML's own rules (``3``, ``1e-5``, ``[1, 2]``, ``"adam"``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string


def parse_overrides(overrides: dict[str, Any] | list[str]) -> dict[str, Any]:
    """``["schedule.epochs=3"]`` -> ``{"schedule.epochs": 3}``; a dict is taken as it is."""
    if not isinstance(overrides, list):
        return overrides
    parsed = {}
    for item in overrides:
        if "=" not in item:
            raise HarnessError(f"override '{item}' must look like key.path=value")
        key, text = item.split("=", 1)
        parsed[key.strip()] = parse_value(text.strip())
    return parsed


def set_dotted_keys(table: dict[str, Any], overrides: dict[str, Any]) -> tuple[Deviation, ...]:
    """Set each ``section.key`` of ``overrides`` in ``table`` (a protocol's every field), in
    place; returns a :class:`Deviation` for each value that differs from the table's.

    A key the table does not hold is refused, with the closest spelling. Two kinds of key
    may be set though the protocol file does not list them (:func:`_unlisted_default`):
    a method's declared option and a loss's ``reduction``. Set to their current value, they
    are left out again, so the protocol (and its fingerprint) is unchanged."""
    deviations = []
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if parts[0] == "deviations":
            raise HarnessError(
                f"'{dotted}' documents the protocol and is not a setting; edit the protocol file"
            )
        unlisted, default = _unlisted_default(table, parts)
        if unlisted:
            _insert(table, parts, default)
        node = _parent_table(table, dotted, parts)
        old = node[parts[-1]]
        node[parts[-1]] = value
        if jsonable(value) != old:
            deviations.append(Deviation(dotted, old, value))
        elif unlisted:  # set to the default: the protocol (and its fingerprint) is unchanged
            del node[parts[-1]]
            if not node and parts[0] == "methods":
                del table["methods"][parts[1]]
            elif not node and parts[:2] == ["loss", "args"]:
                del table["loss"]["args"][parts[2]]
    return tuple(deviations)


def _unlisted_default(table: dict[str, Any], parts: list[str]) -> tuple[bool, Any]:
    """Whether ``parts`` is a key the protocol may set though ``table`` does not list it,
    and its current value: ``methods.<method>.<option>`` for any option the method
    declares (its default), ``loss.args.<loss>.reduction`` for any loss the protocol has
    arguments for (``"pml"``, PML's own reduction), and ``loss.args.<loss>.<argument>``
    for an argument the loss registry gives a default (that default)."""
    if parts[0] == "methods" and len(parts) == 3:
        return _unlisted_method_option(table, parts[1], parts[2])
    if parts[:2] == ["loss", "args"] and len(parts) == 4 and parts[3] != "reduction":
        section = table["loss"]["args"].get(parts[2])
        if parts[2] in LOSSES and (not isinstance(section, dict) or parts[3] not in section):
            defaults = LOSSES.get(parts[2]).defaults
            return parts[3] in defaults, defaults.get(parts[3])
    if parts[:2] == ["loss", "args"] and len(parts) == 4 and parts[3] == "reduction":
        # Imported when used: importing the config layer stays free of torch and PML.

        section = table["loss"]["args"].get(parts[2])
        return isinstance(section, dict) and "reduction" not in section, PML_REDUCTION
    return False, None


def _unlisted_method_option(table: dict[str, Any], method: str, option: str) -> tuple[bool, Any]:
    """Whether option ``option`` of ``method`` is absent from ``table``, and the method's
    default for it; an option the method does not declare is refused."""
    # Imported when used: importing the config layer stays free of torch (the plugins load it).

    options = METHODS.get(method).options()
    if option not in options:
        raise HarnessError(
            f"unknown option '{option}' for method '{method}' in --set methods.{method}.{option}; "
            f"valid: {', '.join(sorted(options)) or 'none'}"
        )
    listed = table["methods"].get(method, {})
    return option not in listed, jsonable(options[option])


def _insert(table: dict[str, Any], parts: list[str], value: Any) -> None:
    """Set ``parts`` of ``table`` to ``value``, creating the tables on the way."""
    node = table
    for part in parts[:-1]:
        if part not in node:
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def _parent_table(table: dict[str, Any], dotted: str, parts: list[str]) -> dict[str, Any]:
    """The table that holds the last of ``parts``; a key on the way that ``table`` does not
    hold (or that is not a table) is refused, with the closest spelling."""
    node = table
    for depth, part in enumerate(parts):
        if part not in node or (depth < len(parts) - 1 and not isinstance(node[part], dict)):
            raise HarnessError(
                f"unknown protocol key '{dotted}'{_suggestion(parts[:depth], part, node)}"
            )
        if depth < len(parts) - 1:
            node = node[part]
    return node


def _suggestion(path: list[str], key: str, table: dict[str, Any]) -> str:
    """`` (did you mean 'optimizer.lr_head'?)`` for a misspelt ``key`` of ``table`` (a close
    spelling, else the keys it begins), or ""."""
    names = [str(k) for k in table]
    close = difflib.get_close_matches(key, names, n=1) or [n for n in names if n.startswith(key)]
    if not close:
        return ""
    return " (did you mean " + " or ".join(f"'{'.'.join([*path, name])}'" for name in close) + "?)"
