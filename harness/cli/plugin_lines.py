"""The ``methods`` lines of the plugins that installed packages register, kept between calls.

A package's plugin is listed from its class, so listing it imports the plugin and torch
(seconds on a laptop). Its lines change only with its files: they are kept in
``method-plugins.json`` under :func:`~harness.store.environment.cache_folder`, keyed by each
entry point (name, module, distribution and version) and a digest of the Python files of
its top-level package, and read back while every key still matches."""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib.metadata import EntryPoint
from importlib.util import find_spec
from pathlib import Path

from harness.base.atomic import atomic_write_json, sha256_file
from harness.base.errors import HarnessError
from harness.base.registry import source_digest
from harness.store.environment import cache_folder

__all__ = ["package_plugin_lines", "LISTING_FILE"]

LISTING_FILE = "method-plugins.json"


def package_plugin_lines(entry_points: Iterable[EntryPoint], built_in: set[str]) -> dict[str, str]:
    """``{name: lines}`` of the methods that the packages of ``entry_points`` register
    (every registered method not in ``built_in``): kept lines while the packages' files are
    those they were read from, else read from the registry (which imports the plugins) and
    kept."""
    points = list(entry_points)
    if not points:
        return {}
    key = _entry_point_key(points)
    path = cache_folder() / LISTING_FILE
    kept = _read(path)
    if key is not None and kept.get("key") == key:
        return kept["lines"]
    # deferred: the plugins and torch, which they build on, load only when the kept lines
    # do not match the installed packages
    from harness.methods.listing import method_lines

    lines = {name: line for name, line in method_lines().items() if name not in built_in}
    if key is not None:
        try:
            atomic_write_json(path, {"key": key, "lines": lines})
        except (OSError, HarnessError):
            pass  # an unwritable cache folder: the next call reads the registry again
    return lines


def _entry_point_key(entry_points: Iterable[EntryPoint]) -> list[list[str]] | None:
    """Per entry point: its name, module, distribution, version and the digest of the
    Python files of its top-level package (or module); None where one cannot be found
    without running it."""
    key = []
    for point in sorted(entry_points, key=lambda p: (p.name, p.value)):
        digest = _source_digest(point.module.split(".")[0])
        if digest is None:
            return None
        dist = point.dist
        key.append(
            [
                point.name,
                point.value,
                dist.name if dist else "",
                dist.version if dist else "",
                digest,
            ]
        )
    return key


def _source_digest(top_level: str) -> str | None:
    """The digest of package ``top_level``'s Python files, or of module ``top_level``'s
    file; found without importing it."""
    try:
        spec = find_spec(top_level)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        folders = map(Path, spec.submodule_search_locations)
        return ",".join(source_digest(folder, recursive=True) for folder in folders)
    if spec.origin and Path(spec.origin).is_file():
        return sha256_file(spec.origin)
    return None


def _read(path: Path) -> dict:
    """The kept listing, or ``{}`` where there is none or it cannot be read."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) and isinstance(kept.get("lines"), dict) else {}
