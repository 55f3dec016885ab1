"""What a method may be registered as: one item of ``--methods a,b`` and of a grid's
``methods`` list, never the word that stands for them all."""

from __future__ import annotations

import re

__all__ = ["ALL_METHODS", "method_name_rule"]

#: What a method's name may hold: it is one item of ``--methods a,b`` and of a grid's
#: ``methods`` list.
_METHOD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: The word that stands for every registered method (``--methods all``, ``methods = "all"``).
ALL_METHODS = "all"


def method_name_rule(name: str) -> str | None:
    """Why ``name`` cannot name a method (None when it can): ``all`` is reserved, and a
    name is letters, digits, ``_``, ``.`` and ``-`` (a comma would split it in two)."""
    if name == ALL_METHODS:
        return 'is reserved: --methods all and a grid\'s methods = "all" stand for every method'
    if not _METHOD_NAME.fullmatch(name):
        return (
            "is not a method name: expected letters, digits, '_', '.' and '-', starting with "
            "a letter or digit (--methods takes a comma-separated list)"
        )
    return None
