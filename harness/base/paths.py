"""Output paths checked before any work starts: a command that would fail to write its
result after minutes (or hours) of training is refused up front instead, with one line
naming the flag, the path and what is wrong with it.

A path is writable when its nearest existing ancestor is a folder the process can create
a file in. That is probed by creating (and at once removing) a temporary file there,
not by permission bits: ``os.access`` answers yes to root on a read-only folder, and
knows nothing of read-only mounts or ``/proc``. Nothing is created for a path that does
not exist yet; the writer creates its folders when it has a result.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from harness.base.errors import HarnessError

__all__ = ["writable_file", "writable_folder", "writable_stem", "readable_file"]


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (``.`` for a bare relative name)."""
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return Path(".")


def _check_can_create_in(folder: Path, shown: str, flag: str, what: str) -> None:
    """Refuse ``shown`` (to be created in ``folder``) when ``folder``'s nearest existing
    ancestor is a file, or a folder that refuses new files."""
    anchor = _nearest_existing(folder)
    if not anchor.is_dir():
        raise HarnessError(f"{flag} {shown}: {anchor} is a file, not a folder; give a {what} in a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=anchor)
    except OSError as err:
        raise HarnessError(f"{flag} {shown}: cannot write in {anchor} ({err.strerror or err}); "
                           f"give a {what} in a writable folder") from None
    os.close(fd)
    os.unlink(probe)


def writable_file(text: str | os.PathLike | None, flag: str) -> Path | None:
    """``text`` as the path of a file the command will write, checked: not a folder (nor
    a name ending in ``/``), inside a folder that exists or can be created, writable.
    None stays None (the flag was not given)."""
    if text is None:
        return None
    raw = os.fspath(text)
    path = Path(raw)
    if not raw.strip():
        raise HarnessError(f"{flag} is empty; give a file name")
    if raw.endswith(("/", os.sep)) or path.is_dir():
        raise HarnessError(f"{flag} {raw} is a folder; give a file name")
    _check_can_create_in(path.parent, raw, flag, "file")
    return path


def writable_stem(text: str | os.PathLike | None, flag: str, suffixes: tuple[str, ...]) -> Path | None:
    """An output path without suffix (``STEM.md``, ``STEM.tex``...): ``text`` must name a
    file stem, not a folder, and every ``STEM + suffix`` must be writable."""
    path = writable_file(text, flag)
    if path is not None:
        for suffix in suffixes:
            writable_file(f"{path}{suffix}", flag)
    return path


def writable_folder(text: str | os.PathLike | None, flag: str) -> Path | None:
    """``text`` as a folder the command will create files in, checked: not a file, and
    either an existing writable folder or one that can be created (its nearest existing
    ancestor a writable folder). Not created here."""
    if text is None:
        return None
    raw = os.fspath(text)
    if not raw.strip():
        raise HarnessError(f"{flag} is empty; give a folder")
    path = Path(raw)
    if path.exists() and not path.is_dir():
        raise HarnessError(f"{flag} {raw} is a file, not a folder")
    _check_can_create_in(path, raw, flag, "folder")
    return path


def readable_file(text: str | os.PathLike | None, flag: str) -> Path | None:
    """``text`` as an input file, checked: it exists, is a file (not a folder) and can be
    opened. None stays None (the flag was not given)."""
    if text is None:
        return None
    path = Path(text)
    if not path.exists():
        raise HarnessError(f"{flag} {path} does not exist")
    if not path.is_file():
        raise HarnessError(f"{flag} {path} is a folder, not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise HarnessError(f"{flag} {path} cannot be read ({err.strerror or err})") from None
    return path
