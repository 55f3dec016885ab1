"""The command line of this process as the user typed it: the command line records it
before its command runs, and each run it starts records it as its source
(:func:`harness.store.provenance.source_tags`). A module of its own, without torch or
MLflow, because every command, ``--help`` included, records its invocation first."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["record_invocation", "invocation"]

#: The command line of this process as the user typed it (:func:`record_invocation`).
_invocation: list[str] = []


def record_invocation(program: str, argv: list[str]) -> None:
    """Remember the command this process runs (``program``, e.g. ``python -m harness``, and
    its arguments), which the runs it starts record as their source."""
    _invocation[:] = [*program.split(), *argv]


def invocation() -> list[str]:
    """The recorded command line, else this process's ``sys.argv`` (Python callers)."""
    if _invocation:
        return list(_invocation)
    return [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
