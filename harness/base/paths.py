"""Output paths checked before any work starts: a command that would fail to write its
result after minutes (or hours) of training is refused up front instead, with one line
naming the flag, the path and what is wrong with it.

A path is writable when its nearest existing ancestor is a folder the process can create
a file in. That is probed by creating (and at once removing) a temporary file there,
not by permission bits: ``os.access`` answers yes to root on a read-only folder, and
knows nothing of read-only mounts or ``/proc``. Nothing is created for a path that does
not exist yet; the writer creates its folders when it has a result.

An output never takes the place of data: a path that is a device, a FIFO, a socket or a
folder is refused (an atomic writer would rename its file over the device node), as is an
existing SQLite database (a tracking store, an Optuna study, a sweep queue) and any
:class:`ReservedPath` the caller names (the tracking store's database and artifact
folder, :func:`harness.store.location.reserved_paths`).

An output replaces only what the harness wrote (:class:`Replacing`): a path that does not
exist, or a file the folder's record names with the digest it still has
(:mod:`harness.base.written`); an output of the harness changed since is replaced with
``--force``. A file the harness did not write is never replaced, whatever its content; nor
is one of the command's own inputs (or a file inside an input folder), nor a file among
the harness's records (a run's checkpoint folder, a dataset's folder).
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from harness.base.errors import HarnessError

__all__ = [
    "ReservedPath",
    "WRITTEN_RECORD",
    "Replacing",
    "writable_file",
    "writable_folder",
    "writable_stem",
    "readable_file",
    "read_text",
    "is_sqlite_database",
    "special_file_kind",
    "NAME_MAX",
]

#: The first 16 bytes of every SQLite 3 database file.
SQLITE_HEADER = b"SQLite format 3\x00"
#: The longest file or folder name, in bytes, that common file systems take (ext4, XFS,
#: Btrfs, APFS); an output path with a longer name is refused before any work.
NAME_MAX = 255
#: The record of the outputs the harness wrote in a folder (:mod:`harness.base.written`).
WRITTEN_RECORD = ".harness-written.json"
#: Files SQLite keeps beside a database while it is open; part of the database.
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


@dataclass(frozen=True)
class ReservedPath:
    """A place no output may take: the file ``path`` (with SQLite's companion files), or,
    with ``folder``, the folder ``path`` and everything below it. ``what`` names it in the
    refusal, e.g. "the tracking store's database (sqlite:///results/mlflow.db)"."""

    path: Path
    what: str
    folder: bool = False

    def holds(self, candidate: Path) -> bool:
        """Whether ``candidate`` (resolved) is this place or, for a folder, inside it."""
        own = self.path.resolve()
        if self.folder:
            return candidate == own or own in candidate.parents
        return candidate.parent == own.parent and candidate.name in (
            own.name,
            *(own.name + suffix for suffix in SQLITE_COMPANIONS),
        )


@dataclass(frozen=True)
class Replacing:
    """What an output path may replace. ``provenance(path)``: ``absent``, ``unchanged``,
    ``changed`` or ``foreign`` (:func:`harness.base.written.provenance`: whether the harness
    wrote the file, and whether it changed since); ``force``: the user replaces a changed
    output of the harness (``--force``); ``inputs``: (flag, path) of the command's input
    files and folders, never replaced nor written into; ``record``: names a path among the
    harness's records (never replaced), else None."""

    provenance: Callable[[Path], str] = field(default=lambda _path: "foreign", compare=False)
    force: bool = False
    inputs: tuple[tuple[str, Path], ...] = ()
    record: Callable[[Path], str | None] = field(default=lambda _path: None, compare=False)

    def check(self, path: Path, raw: str, flag: str) -> None:
        """Refuse ``path`` when writing it would replace what the harness did not write."""
        resolved = path.resolve()
        for in_flag, given in self.inputs:
            own = given.resolve()
            if own == resolved:
                raise HarnessError(
                    f"{flag} {raw} is the command's input {in_flag}; give another file name"
                )
            if own in resolved.parents:
                raise HarnessError(
                    f"{flag} {raw} is inside the command's input {in_flag} {given}; "
                    f"give a file outside it"
                )
        record = self.record(resolved)
        if record is not None:
            raise HarnessError(
                f"{flag} {raw} is {record}, which no output replaces; give another file name"
            )
        state = self.provenance(path)
        if state == "changed" and not self.force:
            raise HarnessError(
                f"{flag} {raw} is an output of the harness changed since it was written; "
                f"give --force to replace it, or a new file name"
            )
        if state == "foreign":
            raise HarnessError(
                f"{flag} {raw} exists and the harness did not write it (no entry in "
                f"{path.parent / WRITTEN_RECORD}); give a new file name: an output replaces "
                f"only the harness's own, --force included"
            )


def special_file_kind(path: Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file (symbolic links followed):
    "a folder", "a character device", "a FIFO"...; None for a regular file or no file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def is_sqlite_database(path: Path) -> bool:
    """Whether ``path`` is an existing regular file that starts with SQLite's header."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        return False


def _check_not_reserved(
    path: Path, raw: str, flag: str, reserved: Iterable[ReservedPath], noun: str
) -> None:
    resolved = path.resolve()
    for place in reserved:
        if place.holds(resolved):
            where = "is" if resolved == place.path.resolve() or not place.folder else "is inside"
            raise HarnessError(
                f"{flag} {raw} {where} {place.what}; give a {noun} outside the store"
            )


def _check_not_data(path: Path, raw: str, flag: str, reserved: Iterable[ReservedPath]) -> None:
    """Refuse an output path that would replace a reserved place, a special file or a
    database: the writer renames over whatever is there."""
    _check_not_reserved(path, raw, flag, reserved, "path")
    kind = special_file_kind(path)
    if kind is not None:
        raise HarnessError(f"{flag} {raw} is {kind}, not a regular file; give a file name")
    if is_sqlite_database(path):
        raise HarnessError(
            f"{flag} {raw} is an SQLite database (a tracking store, study or queue); "
            f"give another file name"
        )


def _check_name_lengths(path: Path, flag: str, what: str) -> None:
    """Refuse a path with a file or folder name longer than :data:`NAME_MAX` bytes (the
    write would fail with ENAMETOOLONG once the command has its result)."""
    for name in path.parts:
        size = len(os.fsencode(name))
        if size > NAME_MAX:
            raise HarnessError(
                f"{flag}: the name '{name[:24]}...' is {size} bytes long; expected a {what} "
                f"name of at most {NAME_MAX} bytes"
            )


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
        raise HarnessError(
            f"{flag} {shown}: {anchor} is a file, not a folder; give a {what} in a folder"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=anchor)
    except OSError as err:
        raise HarnessError(
            f"{flag} {shown}: cannot write in {anchor} ({err.strerror or err}); "
            f"give a {what} in a writable folder"
        ) from None
    os.close(fd)
    os.unlink(probe)


def writable_file(
    text: str | os.PathLike | None,
    flag: str,
    *,
    reserved: Iterable[ReservedPath] = (),
    replacing: Replacing | None = None,
) -> Path | None:
    """``text`` as the path of a file the command will write, checked: not a folder (nor
    a name ending in ``/``), not a device, FIFO or socket, not an existing SQLite database,
    not in a ``reserved`` place, not a file ``replacing`` refuses, inside a folder that
    exists or can be created, writable. None stays None (the flag was not given)."""
    if text is None:
        return None
    raw = os.fspath(text)
    path = Path(raw)
    if not raw.strip():
        raise HarnessError(f"{flag} is empty; give a file name")
    _check_name_lengths(path, flag, "file")
    if raw.endswith(("/", os.sep)) or path.is_dir():
        raise HarnessError(f"{flag} {raw} is a folder; give a file name")
    _check_not_data(path, raw, flag, reserved)
    if replacing is not None:
        replacing.check(path, raw, flag)
    _check_can_create_in(path.parent, raw, flag, "file")
    return path


def writable_stem(
    text: str | os.PathLike | None,
    flag: str,
    suffixes: tuple[str, ...],
    *,
    reserved: Iterable[ReservedPath] = (),
    replacing: Replacing | None = None,
) -> Path | None:
    """An output path without suffix (``STEM.md``, ``STEM.tex``...): ``text`` must name a
    file stem, not a folder, and every ``STEM + suffix`` must be writable (``replacing``:
    what those files may replace)."""
    reserved = tuple(reserved)
    path = writable_file(text, flag, reserved=reserved)
    if path is not None:
        for suffix in suffixes:
            writable_file(
                f"{path}{suffix}",
                flag,
                reserved=reserved,
                replacing=replacing,
            )
    return path


def writable_folder(
    text: str | os.PathLike | None, flag: str, *, reserved: Iterable[ReservedPath] = ()
) -> Path | None:
    """``text`` as a folder the command will create files in, checked: not a file, not in
    a ``reserved`` place, and either an existing writable folder or one that can be created
    (its nearest existing ancestor a writable folder). Not created here."""
    if text is None:
        return None
    raw = os.fspath(text)
    if not raw.strip():
        raise HarnessError(f"{flag} is empty; give a folder")
    path = Path(raw)
    _check_name_lengths(path, flag, "folder")
    _check_not_reserved(path, raw, flag, reserved, "folder")
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


def read_text(path: Path, what: str) -> str:
    """The text of the input file ``path``, a ``what`` (``TOML``, ``CSV``) file: a file that
    is not UTF-8 (a binary file given by mistake) is refused, naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise HarnessError(
            f"{path} is not a UTF-8 {what} file (byte {err.start} cannot be decoded)"
        ) from None
    except OSError as err:
        raise HarnessError(f"{path} cannot be read ({err.strerror or err})") from None
