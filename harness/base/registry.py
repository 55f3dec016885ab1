"""Plain-dict registries filled by a decorator that refuses duplicate names."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from harness.base.errors import unknown_name

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """``{name: entry}`` with ``register`` (a decorator), ``get`` and ``list``.

    >>> LOSSES = Registry("loss")
    >>> @LOSSES.register("triplet")
    ... def make_triplet(**kw): ...
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise unknown_name(self.kind, name, self._entries) from None

    def list(self, pattern: str = "*") -> list[str]:
        return sorted(n for n in self._entries if fnmatch.fnmatch(n, pattern))

    def registered(self) -> list[str]:
        """Every name in the order it was registered (``list`` sorts)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.list())

    def __len__(self) -> int:
        return len(self._entries)
