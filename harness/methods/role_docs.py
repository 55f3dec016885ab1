"""The table of roles in ``docs/writing-a-plugin.md``, rendered from the protocols of
:mod:`harness.methods.roles`: each member with the first sentence of its docstring (its
``#:`` comment for an attribute), and which of this package's plugins take each role.
``nox -s docs`` writes it; ``tests/methods/test_roles.py`` fails when the page differs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from harness.methods.base import METHODS
from harness.methods.roles import ROLES, role_members

__all__ = ["BEGIN", "END", "role_table", "with_role_table", "write_role_table"]

#: The lines that enclose the rendered table on the page.
BEGIN = "<!-- roles-table: rendered from harness/methods/roles.py by nox -s docs -->"
END = "<!-- /roles-table -->"


def _code_span(ref: re.Match[str]) -> str:
    """A reST cross-reference as a code span (``~``: the last component only)."""
    return f"`{ref.group(2).rsplit('.', 1)[-1] if ref.group(1) else ref.group(2)}`"


def _first_sentence(text: str) -> str:
    """The first sentence of ``text`` in markdown: reST's cross-references and double
    backquotes become code spans."""
    flat = " ".join(text.split())
    found = re.match(r"(.+?[^.]\.)(\s|$)", flat)
    sentence = found.group(1) if found else flat
    sentence = re.sub(r":\w+:`(~?)([\w.]+)`", _code_span, sentence)
    return sentence.replace("``", "`").replace("|", "\\|")


def _attribute_notes(role: type) -> dict[str, str]:
    """The ``#:`` comment above each attribute of ``role``'s body."""
    notes: dict[str, str] = {}
    comment: list[str] = []
    for line in inspect.getsource(role).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            comment.append(stripped[2:].strip())
            continue
        found = re.match(r"(\w+)\s*:", stripped)
        if found and comment:
            notes[found.group(1)] = " ".join(comment)
        comment = []
    return notes


def _member_row(role: type, member: str, notes: dict[str, str]) -> str:
    value = vars(role).get(member)
    func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    if callable(func):
        params = [p for p in inspect.signature(func).parameters if p not in ("self", "cls")]
        name = f"`{member}`" if isinstance(value, property) else f"`{member}({', '.join(params)})`"
        text = inspect.getdoc(func) or ""
    else:
        name, text = f"`{member}`", notes.get(member, "")
    return f"| {name} | {_first_sentence(text)} |"


def _plugins(role: type) -> str:
    """This package's plugins that declare ``role``: one registered name per class (the
    first in name order), variants left out."""
    first: dict[type, str] = {}
    for name in METHODS.list():
        cls = METHODS.get(name).cls
        if cls.__module__.startswith("harness.methods."):
            first.setdefault(cls, name)
    names = sorted(n for cls, n in first.items() if role in cls.__mro__)
    return ", ".join(f"`{n}`" for n in names) or "none"


def role_table() -> str:
    """The markdown of every role: its members, then which plugins take it."""
    lines = ["| role | member | what the engine does with it |", "|---|---|---|"]
    for role in ROLES:
        notes = _attribute_notes(role)
        for i, member in enumerate(role_members(role)):
            label = f"`{role.__name__}`" if i == 0 else ""
            lines.append(f"| {label} " + _member_row(role, member, notes))
    lines += ["", "| role | what it is | plugins of this repository |", "|---|---|---|"]
    for role in ROLES:
        what = _first_sentence(inspect.getdoc(role) or "")
        lines.append(f"| `{role.__name__}` | {what} | {_plugins(role)} |")
    return "\n".join(lines) + "\n"


def with_role_table(page: str) -> str:
    """``page`` with the text between :data:`BEGIN` and :data:`END` replaced by the table."""
    start, stop = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + role_table() + page[stop:]


def write_role_table(path: str | Path) -> None:
    """Render the table into the page at ``path`` (``docs/writing-a-plugin.md``)."""
    page = Path(path)
    page.write_text(with_role_table(page.read_text(encoding="utf-8")), encoding="utf-8")
