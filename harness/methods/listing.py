"""What ``python -m harness methods`` prints of each registered plugin, and the catalog of
the built-in ones that lets it print them without importing a plugin (and torch).

A plugin's line is its name and description, then its paper (or ``harness baseline``) and
its options with their defaults (:func:`method_lines`). The built-in plugins' lines are
also written, once, into :mod:`harness.config.method_catalog` (:func:`write_method_catalog`,
run by ``nox -s docs``) with the digest of the plugin files they come from: ``methods``
reads the catalog only while the files are those (an edited or added plugin is listed
from the registry), and a test checks that the committed catalog is the registry's."""

from __future__ import annotations

import json
from pathlib import Path

from harness.base.atomic import atomic_write_text
from harness.base.registry import source_digest
from harness.methods.base import METHODS, MethodEntry

__all__ = [
    "method_line",
    "method_lines",
    "catalog_text",
    "write_method_catalog",
    "PLUGINS",
    "CATALOG",
]

#: The folder of the built-in plugins, and the generated module of their lines.
PLUGINS = Path(__file__).resolve().parent
CATALOG = PLUGINS.parent / "config" / "method_catalog.py"


def method_line(entry: MethodEntry) -> str:
    """One plugin as ``methods`` lists it: two lines, name and description, then its paper
    and options."""
    paper = entry.cls.paper
    source = f"{paper.title} ({paper.year})" if paper else "harness baseline"
    options = ", ".join(f"{k}={v!r}" for k, v in entry.options().items()) or "none"
    return f"{entry.name:14s} {entry.description}\n{'':14s} {source}; options: {options}"


def method_lines(*, built_in: bool = False) -> dict[str, str]:
    """Every registered plugin's :func:`method_line`, by name, in name order; with
    ``built_in``, those of the harness's own plugins only (no installed package's)."""
    entries = [METHODS.get(name) for name in METHODS]
    return {
        entry.name: method_line(entry)
        for entry in entries
        if not built_in or entry.cls.__module__.startswith(f"{__package__}.")
    }


def catalog_text(lines: dict[str, str], digest: str) -> str:
    """The source of :mod:`harness.config.method_catalog` holding ``lines``, written from
    the plugin files of ``digest`` (:func:`~harness.base.registry.source_digest`)."""
    body = "".join(
        f"    {json.dumps(name)}: {json.dumps(text, ensure_ascii=False)},\n"
        for name, text in lines.items()
    )
    return (
        '"""The built-in method plugins as ``python -m harness methods`` lists them, read\n'
        "without importing the plugins (and torch). Written by\n"
        ":func:`harness.methods.listing.write_method_catalog` (``nox -s docs``) from the\n"
        'registry; a test checks it against the registry."""\n\n'
        '__all__ = ["SOURCE_DIGEST", "METHOD_LINES"]\n\n'
        "#: The plugin files the lines were written from (a catalog of other files is not read).\n"
        f"SOURCE_DIGEST = {json.dumps(digest)}\n"
        "#: Each built-in plugin's lines, by name, in name order.\n"
        f"METHOD_LINES = {{\n{body}}}\n"
    )


def write_method_catalog(path: Path | str = CATALOG) -> None:
    """Write the built-in plugins' lines to ``path`` (:mod:`harness.config.method_catalog`)."""
    atomic_write_text(path, catalog_text(method_lines(built_in=True), source_digest(PLUGINS)))
