"""Plain-dict registries filled by a decorator that refuses duplicate names, and the
plugins of installed packages, found through an entry-point group."""

from __future__ import annotations

import builtins
import contextlib
import fnmatch
import hashlib
import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Generic, TypeVar

from harness.base.errors import HarnessError, unknown_name

__all__ = [
    "NameTaken",
    "BadName",
    "Registry",
    "import_modules",
    "METHOD_PLUGIN_GROUP",
    "source_digest",
]

T = TypeVar("T")

#: The entry-point group through which an installed package registers method plugins
#: (``[project.entry-points."dml_harness.methods"]``): here, below the plugins, so that a
#: command can ask whether any is installed without importing them.
METHOD_PLUGIN_GROUP = "dml_harness.methods"


class NameTaken(ValueError):
    """A name registered twice."""


class BadName(ValueError):
    """A name its registry's rule refuses (a reserved word, a character that splits lists)."""


class Registry(Generic[T]):
    """``{name: entry}`` with ``register`` (a decorator), ``get`` and ``list``.

    With ``entry_point_group``, the first lookup (``get``, ``list``, ``in``, ...) also
    imports, once, every entry point of that group that an installed distribution
    declares; importing one registers its entries. A plugin that fails to import (or
    exits), that registers a name already taken or one ``name_rule`` refuses, or that
    registers nothing is a
    :class:`~harness.base.errors.HarnessError` naming the distribution and the entry
    point, raised by that lookup and every later one.

    >>> LOSSES = Registry("loss")
    >>> @LOSSES.register("triplet")
    ... def make_triplet(**kw): ...
    """

    def __init__(
        self,
        kind: str,
        *,
        entry_point_group: str = "",
        name_rule: Callable[[str], str | None] | None = None,
    ):
        """``name_rule(name)``: why ``name`` cannot be registered (None when it can)."""
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.name_rule = name_rule
        self._entries: dict[str, T] = {}
        self._plugins_loaded = not entry_point_group
        self._plugin_error: HarnessError | None = None

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            why = self.name_rule(name) if self.name_rule is not None else None
            if why is not None:
                raise BadName(f"{self.kind} name {name!r} {why}")
            if name in self._entries:
                raise NameTaken(f"{self.kind} '{name}' is already registered")
            self._entries[name] = entry
            return entry

        return add

    def remove(self, name: str) -> None:
        """Unregister ``name`` (a plugin registered for a test)."""
        del self._entries[name]

    @contextlib.contextmanager
    def temporarily(self, name: str, entry: T) -> Iterator[T]:
        """``entry`` registered under ``name`` for the ``with`` block and removed when it
        ends, however it ends: a plugin that exists for one test. The name is checked as
        :meth:`register` checks it (a name taken or refused raises).

        >>> with METHODS.temporarily("nan-test", MethodEntry("nan-test", NanHead, {})):
        ...     main(["run", "--methods", "nan-test"])
        """
        self.register(name)(entry)
        try:
            yield entry
        finally:
            self.remove(name)

    def get(self, name: str) -> T:
        entries = self._loaded()
        try:
            return entries[name]
        except KeyError:
            raise unknown_name(self.kind, name, entries) from None

    def list(self, pattern: str = "*") -> list[str]:
        return sorted(n for n in self._loaded() if fnmatch.fnmatch(n, pattern))

    def registered(self) -> builtins.list[str]:
        """Every name in the order it was registered (``list`` sorts)."""
        return list(self._loaded())

    def __contains__(self, name: object) -> bool:
        return name in self._loaded()

    def __iter__(self) -> Iterator[str]:
        return iter(self.list())

    def __len__(self) -> int:
        return len(self._loaded())

    # ------------------------------------------------------------------ installed plugins

    def _loaded(self) -> dict[str, T]:
        """The entries, once the entry points of installed plugins are imported."""
        if not self._plugins_loaded:
            self._plugins_loaded = True  # first, so that a plugin's own lookups do not recurse
            try:
                for point in entry_points(group=self.entry_point_group):
                    self._load_plugin(point)
            except HarnessError as err:
                self._plugin_error = err
        if self._plugin_error is not None:
            raise self._plugin_error
        return self._entries

    def _load_plugin(self, point: EntryPoint) -> None:
        """Import one entry point; a module imported for the first time must register a new name."""
        before, imported_before = set(self._entries), point.module in sys.modules
        try:
            point.load()
        except (NameTaken, BadName) as err:
            raise HarnessError(
                f"{self._plugin_label(point)}: {err}; rename the plugin's {self.kind}"
            ) from err
        except SystemExit as err:  # the command would end here, silently, with its status
            raise HarnessError(
                f"{self._plugin_label(point)} called sys.exit({err.code!r}) when imported; "
                f"a plugin's import only registers its {self.kind}s"
            ) from err
        except Exception as err:  # a plugin's import may fail in any way; the user needs its name
            raise HarnessError(
                f"{self._plugin_label(point)} failed to load: {type(err).__name__}: {err}"
            ) from err
        if not imported_before and not set(self._entries) - before:
            raise HarnessError(
                f"{self._plugin_label(point)} registered no {self.kind} when imported"
            )

    def _plugin_label(self, point: EntryPoint) -> str:
        """``method plugin 'gem' (entry point gem = "gem_plugin" of distribution gem-plugin 0.1,
        group dml_harness.methods)``."""
        dist = f"{point.dist.name} {point.dist.version}" if point.dist is not None else "unknown"
        return (
            f"{self.kind} plugin '{point.name}' (entry point {point.name} = \"{point.value}\" of "
            f"distribution {dist}, group {self.entry_point_group})"
        )


def import_modules(package: str, path: Iterable[str], *, skip: Iterable[str] = ()) -> None:
    """Import every module of ``package`` (its ``__name__`` and ``__path__``) in name order,
    but those in ``skip`` and those named with ``_``: a module whose decorators register its
    entries is then registered by adding its file."""
    left_out = set(skip)
    for module in sorted(info.name for info in pkgutil.iter_modules(path)):
        if module not in left_out and not module.startswith("_"):
            importlib.import_module(f"{package}.{module}")


def source_digest(folder: Path, *, recursive: bool = False) -> str:
    """The sha256 of the Python files of ``folder`` (``recursive``: and of its subfolders;
    names relative to ``folder`` and contents, in name order): a catalog written from the
    plugins of a package holds its digest, and is read only while the package's files are
    the ones it was written from."""
    files = folder.rglob("*.py") if recursive else folder.glob("*.py")
    digest = hashlib.sha256()
    for name, path in sorted((p.relative_to(folder).as_posix(), p) for p in files):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
