"""The plugin contract's hook table is the code's: the table in the docstring of
``harness/methods/base.py`` (rendered on the API page, docs/api/methods-base.md) names every
hook ``Method`` defines and nothing else, each one the harness calls, and the attributes it
lists are ``Method``'s."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import harness.methods.base as contract
from harness.methods import Method

REPO = Path(__file__).resolve().parents[2]
#: What ``Method`` defines that a plugin does not override: the checked entry point that
#: calls ``embed``, the helper for ``optimizer_groups`` and the accessor of what ``setup``
#: received.
NOT_HOOKS = {"forward", "head_parameters", "backbone"}
#: The contract's own modules: their default hooks call the others as the engine does.
CONTRACT = {"base.py", "head_data.py", "figures.py", "names.py", "__init__.py"}
#: Hooks that declare what another hook does, for the suite's conformance checks rather
#: than for the engine: ``explains_pairs`` says whether ``pair_maps`` gives maps
#: (tests/engine/test_explain.py holds every registered method to it; the engine calls
#: ``pair_maps`` and takes None as "no maps").
DECLARATIONS = {"explains_pairs"}


def table_hooks(doc: str) -> list[str]:
    """The first column of the docstring's hook table."""
    return re.findall(r"^\| `(\w+)` \|", doc, re.M)


def defined_hooks(cls: type) -> set[str]:
    """The public methods and properties ``cls`` defines in its own body, less
    :data:`NOT_HOOKS`."""
    kinds = (property, classmethod, staticmethod)
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, kinds))
    } - NOT_HOOKS


def attribute_names(paths: list[Path]) -> set[str]:
    """Every ``x.name`` the modules at ``paths`` read or call."""
    return {
        node.attr
        for path in paths
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
    }


def test_the_hook_table_names_every_hook_the_contract_defines():
    table = table_hooks(contract.__doc__ or "")
    assert len(table) == len(set(table)), "a hook listed twice"
    assert set(table) == defined_hooks(Method)


def test_the_harness_calls_every_hook_in_the_table():
    """Each hook is called outside the plugins: by the engine, the reports, the commands
    or the contract's own defaults (``rerank_by_ids`` calls ``rerank_similarity``); a
    declaration (:data:`DECLARATIONS`) by the test suite."""
    plugins = REPO / "harness" / "methods"
    callers = [
        path
        for path in sorted((REPO / "harness").rglob("*.py"))
        if path.parent != plugins or path.name in CONTRACT
    ]
    hooks = set(table_hooks(contract.__doc__ or ""))
    assert hooks - DECLARATIONS - attribute_names(callers) == set()
    tests = sorted((REPO / "tests").rglob("*.py"))
    assert DECLARATIONS <= hooks and DECLARATIONS - attribute_names(tests) == set()


def test_the_attributes_the_docstring_lists_are_the_contracts():
    listed = re.search(r"Attributes the engine reads[^:]*:(.*?)\.", contract.__doc__ or "", re.S)
    assert listed, "the docstring lists no attributes"
    names = re.findall(r"`(\w+)`", listed.group(1))
    head = Method(channels={"s8": 8, "s16": 16, "s32": 32}, embedding_size=8)
    assert names and [n for n in names if not hasattr(head, n)] == []


def test_the_checks_can_fail():
    """A table without a hook the class defines, or with one it does not, is caught."""

    class Extended(Method):
        def new_hook(self) -> str:
            return ""

    doc = contract.__doc__ or ""
    assert set(table_hooks(doc)) != defined_hooks(Extended) | defined_hooks(Method)
    assert "new_hook" not in attribute_names([REPO / "harness" / "methods" / "base.py"])
    assert table_hooks("| `a` | x |\n| `b` | y |\n") == ["a", "b"]
