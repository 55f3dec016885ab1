"""The files the harness wrote, with their digests: what an output may replace.

A file's content says nothing of who wrote it (a user's README holds a Markdown table, a
user's paper a ``\\begin{table}``), so the harness keeps a record instead. Each folder it
writes an output into holds ``.harness-written.json``: the name of every output it wrote
there with the sha256 of what it wrote. An existing file is then one of

- ``unchanged``: named in the record with the digest it still has, the harness's own
  earlier output; a command writes over it;
- ``changed``: named in the record, edited since; replaced only with ``--force``;
- ``foreign``: not named in the record; never replaced, ``--force`` or not.

The record moves with its folder (the names are relative to it). Writers of the same
folder update it under a lock on the folder (``flock``, where the platform has it). The
digests of a set are recorded as pending before the set is written and settled after, so
a writer killed in between leaves its files ``unchanged`` whichever content they hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from harness.base.atomic import atomic_write_json, atomic_write_set, finite_json, sha256_file
from harness.base.errors import HarnessError
from harness.base.paths import WRITTEN_RECORD

try:  # not on Windows: there, writers of one folder are not serialised
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "RECORD_NAME",
    "provenance",
    "refuse_foreign",
    "write_outputs",
    "write_output_json",
    "write_output_with",
    "record_written",
    "foreign_files",
]

#: The record of the outputs the harness wrote in a folder, kept in that folder.
RECORD_NAME = WRITTEN_RECORD
_VERSION = 1


def _digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def _read_record(folder: Path) -> dict[str, list[str]]:
    """``{name: [digests]}`` of ``folder``'s record; empty when there is none or it cannot
    be read (every file then counts as foreign: the safe side)."""
    try:
        data = json.loads((folder / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return {}
    return {
        name: [d for d in digests if isinstance(d, str)]
        for name, digests in files.items()
        if isinstance(name, str) and isinstance(digests, list)
    }


def provenance(path: Path) -> str:
    """What ``path`` is to the harness: ``absent``, ``unchanged``, ``changed`` or
    ``foreign`` (see the module's docstring)."""
    path = Path(path)
    if not path.exists():
        return "absent"
    digests = _read_record(path.resolve().parent).get(path.name)
    if digests is None:
        return "foreign"
    try:
        return "unchanged" if sha256_file(path) in digests else "changed"
    except OSError:
        return "foreign"


def refuse_foreign(path: Path, what: str = "") -> None:
    """The last guard of an output: refuse to write ``path`` over a file the harness did not
    write (the up-front checks refuse it before any work; this one holds for every writer)."""
    if provenance(path) == "foreign":
        raise HarnessError(
            f"cannot write {what or path}: {path} exists and the harness did not write it "
            f"(no entry in {path.parent / RECORD_NAME}); nothing written"
        )


def foreign_files(folder: Path) -> list[Path]:
    """The regular files in ``folder`` (not below it) the harness did not write."""
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.name != RECORD_NAME and provenance(p) == "foreign"
    )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _update(digests: Mapping[Path, str], *, pending: bool) -> None:
    """Record ``digests`` (path -> sha256) in their folders' records. ``pending``: keep each
    name's earlier digests beside the new one (the write has not happened yet)."""
    by_folder: dict[Path, dict[str, str]] = {}
    for path, digest in digests.items():
        by_folder.setdefault(Path(path).resolve().parent, {})[Path(path).name] = digest
    for folder, named in by_folder.items():
        with _locked(folder):
            files = _read_record(folder)
            for name, digest in named.items():
                earlier = [d for d in files.get(name, []) if d != digest] if pending else []
                files[name] = [digest, *earlier[:1]]
            atomic_write_json(folder / RECORD_NAME, {"version": _VERSION, "files": files})


def record_written(paths: Iterable[Path]) -> None:
    """Record files the harness has just written (their digests as they are on disk)."""
    _update({Path(p): sha256_file(p) for p in paths}, pending=False)


def write_outputs(files: Mapping[Path, bytes | str]) -> None:
    """Write several outputs as one set (:func:`~harness.base.atomic.atomic_write_set`)
    and record them; none may replace a foreign file."""
    files = {Path(p): data for p, data in files.items()}
    for path in files:
        refuse_foreign(path)
    digests = {path: _digest(data) for path, data in files.items()}
    _update(digests, pending=True)
    atomic_write_set(dict(files))
    _update(digests, pending=False)


def write_output_json(path: Path, data: Any) -> None:
    """Write one JSON output (``NaN`` and infinities as ``null``) and record it."""
    write_outputs({Path(path): json.dumps(finite_json(data), indent=2, allow_nan=False) + "\n"})


def write_output_with(path: Path, write: Callable[[Path], Any]) -> Path:
    """An output whose bytes a library writes (a figure): ``write(path)`` writes it (through
    an atomic writer), then it is recorded; it may not replace a foreign file."""
    path = Path(path)
    refuse_foreign(path)
    write(path)
    record_written([path])
    return path
