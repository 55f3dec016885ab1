"""The plugin contract is small and its tables are the code's: the table in the docstring of
``harness/methods/base.py`` (rendered on docs/api/methods-base.md) names every member
``Method`` offers a plugin, at most five, and nothing else; every member of every role
(``harness/methods/roles.py``) is used by the harness outside the plugins; and the
engine asks for roles, never calling a role's member on a ``Method`` it has not checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import harness.methods.base as contract
from harness.methods import ROLES, Method
from harness.methods.roles import role_members

REPO = Path(__file__).resolve().parents[2]
#: What ``Method`` defines that a plugin does not write: the checked entry point that calls
#: ``embed``, the helper for ``optimizer_groups``, the accessor of what ``setup`` received,
#: and the hook that adapts a subclass written with one class's hooks.
NOT_MEMBERS = {"forward", "head_parameters", "backbone"}
#: The contract's own modules: their defaults call the other members as the engine does.
CONTRACT = {"base.py", "roles.py", "head_data.py", "figures.py", "names.py", "__init__.py"}
#: Members that declare what another member does, for the suite's conformance checks:
#: ``explains_pairs`` says whether ``pair_maps`` gives maps (tests/methods/test_roles.py).
DECLARATIONS = {"explains_pairs"}


def table_members(doc: str) -> list[str]:
    """The first column of the docstring's table."""
    return re.findall(r"^\| `(\w+)` \|", doc, re.M)


def defined_members(cls: type) -> set[str]:
    """The public methods, properties and declared attributes ``cls`` defines in its own
    body, less :data:`NOT_MEMBERS` and the registration data."""
    kinds = (property, classmethod, staticmethod)
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, kinds))
    } - NOT_MEMBERS | {"stages"}


def attribute_names(paths: list[Path]) -> set[str]:
    """Every ``x.name`` the modules at ``paths`` read or call."""
    return {
        node.attr
        for path in paths
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
    }


def callers() -> list[Path]:
    plugins = REPO / "harness" / "methods"
    return [
        path
        for path in sorted((REPO / "harness").rglob("*.py"))
        if path.parent != plugins or path.name in CONTRACT
    ]


def test_the_table_names_every_member_method_offers_and_they_are_few():
    table = table_members(contract.__doc__ or "")
    assert len(table) == len(set(table)), "a member listed twice"
    assert set(table) == defined_members(Method)
    assert len(table) <= 5


def test_the_harness_uses_every_member_of_method_and_of_every_role():
    """Each member is used outside the plugins: by the engine, the reports, the commands or
    the contract's own defaults; a declaration (:data:`DECLARATIONS`) by the test suite."""
    used = attribute_names(callers())
    members = set(table_members(contract.__doc__ or ""))
    members |= {m for role in ROLES for m in role_members(role)}
    assert members - DECLARATIONS - used == set()
    tests = sorted((REPO / "tests").rglob("*.py"))
    assert DECLARATIONS - attribute_names(tests) == set()


def test_method_has_no_member_of_a_role():
    """A role's members live on the role: ``Method`` answers none of them, so the engine
    cannot call one without asking for the role."""
    head = Method(channels={"s8": 8, "s16": 16, "s32": 32}, embedding_size=8)
    for role in ROLES:
        assert not isinstance(head, role)
        assert [m for m in role_members(role) if hasattr(head, m)] == [], role.__name__


def test_the_checks_can_fail():
    """A table without a member the class defines, or with one it does not, is caught."""

    class Extended(Method):
        def new_hook(self) -> str:
            return ""

    doc = contract.__doc__ or ""
    assert set(table_members(doc)) != defined_members(Extended) | defined_members(Method)
    assert "new_hook" not in attribute_names([REPO / "harness" / "methods" / "base.py"])
    assert table_members("| `a` | x |\n| `b` | y |\n") == ["a", "b"]
