"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never a part.

One helper for every file the harness writes whole (checkpoints, selected weights,
``--json`` records, tables), because the hand-rolled variants it replaces each had a
flaw: a fixed temporary name (``last.tmp``, ``.out.json.tmp``) that two concurrent
writers of the same target share and corrupt, a temporary file left behind when the
writer failed, and no ``fsync`` (after a power loss the rename can survive while the
data does not, leaving an empty or short file under the final name).

The recipe: write to a unique temporary file in the target's folder
(:func:`tempfile.mkstemp`, so the rename stays on one file system and is atomic),
flush and ``fsync`` it, ``os.replace`` it over the target, then ``fsync`` the folder
(where the platform allows) so the rename itself is durable. On any failure,
including ``KeyboardInterrupt``, the temporary file is removed and the target is left
as it was. A write the operating system refuses (a full disk, a read-only or missing
folder) is one :class:`~harness.base.errors.HarnessError` line naming the file, and so is
a target that is not a regular file (a device, a FIFO, a folder) or is an SQLite database:
the rename would replace the device node or the store, so nothing is written. A writer
killed outright (SIGKILL) cannot remove its temporary file; the name carries the host
and pid of its writer, and the next writer of the same target on that host removes it
once that process is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from glob import escape as glob_escape
from pathlib import Path
from typing import IO, Any

from harness.base.errors import HarnessError
from harness.base.paths import NAME_MAX, is_sqlite_database, special_file_kind

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_write_set",
    "atomic_save_torch",
    "finite_json",
    "sha256_file",
    "sync_to_disk",
    "publish_folder",
    "staged_folder",
    "remove_orphans_in",
    "writer_tag",
]


def _umask() -> int:
    # mkstemp creates 0600 files; a written result should get the permissions any other
    # new file gets (0666 minus the umask). Reading the umask means setting it: done once.
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()
_FILE_MODE = 0o666 & ~_UMASK
_FOLDER_MODE = 0o777 & ~_UMASK


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable; not possible everywhere (Windows, some file
    systems refuse ``fsync`` on a directory), where it is skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_to_disk(fh: IO[Any], path: Path) -> None:
    """Flush the temporary file ``fh`` of ``path``, give it the usual permissions and fsync
    it: the one step of every atomic write between its data and its rename.

    The writers look it up on this module at each write, so that a caller observing writes
    can wrap it whole; the fault-injection suite does, at the command's edge
    (:mod:`harness.cli.faults`), to land a kill or a full disk inside a named file's write."""
    fh.flush()
    if hasattr(os, "fchmod"):  # not on Windows
        os.fchmod(fh.fileno(), _FILE_MODE)
    os.fsync(fh.fileno())


def atomic_write(
    path: Path | str,
    write_fn: Callable[[IO[Any]], Any],
    *,
    binary: bool = True,
    before_replace: Callable[[Path], Any] | None = None,
) -> None:
    """Write ``path`` atomically: ``write_fn(fh)`` fills a temporary file beside it.

    ``binary``: the file handle is opened ``"wb"`` (else ``"w"``, UTF-8).
    ``before_replace(tmp_path)``: called once the data is on disk, just before the
    rename (e.g. to record the file's checksum where a reader will look for it first).
    """
    path = Path(path)
    _refuse_to_replace_data(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(path)
        fd, tmp_name = tempfile.mkstemp(
            prefix=f"{_temp_prefix(path)}{_OWNER}.", suffix=".tmp", dir=path.parent
        )
    except OSError as err:
        raise _write_error(path, err) from err
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as fh:
            write_fn(fh)
            sync_to_disk(fh, path)
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError):
            raise _write_error(path, err) from err
        raise
    _fsync_dir(path.parent)


def _refuse_to_replace_data(path: Path) -> None:
    """The last guard of every output: ``os.replace`` puts the new file wherever ``path``
    points, so a device node or a database there would be lost."""
    kind = special_file_kind(path)
    if kind is not None:
        raise HarnessError(
            f"cannot write {path}: it is {kind}, not a regular file; nothing written"
        )
    if is_sqlite_database(path):
        raise HarnessError(
            f"cannot write {path}: it is an SQLite database (a tracking store, study or queue); "
            f"nothing written"
        )


#: Who writes a temporary file, in its name: a process killed mid-write (SIGKILL, power
#: loss) cannot remove it, and the next writer of the same target on this host removes
#: it once that process is gone.
_HOST = socket.gethostname().replace(".", "_").replace("-", "_") or "host"
_OWNER = f"{_HOST}-{os.getpid()}"


def writer_tag(pid: int | None = None) -> str:
    """``HOST-PID``, the writer part of a temporary file's name
    (``.NAME.HOST-PID.RANDOM.tmp``) for process ``pid`` on this host (this process when
    None): the files whose tag names this host and a process that is gone are the orphans
    :func:`remove_orphans_in` removes."""
    return _OWNER if pid is None else f"{_HOST}-{pid}"


def _temp_prefix(path: Path) -> str:
    """``.NAME.``, how the temporary files of ``path`` start: its name, cut short where
    needed so that the longest of them, ``.NAME.HOST-PID.RANDOM.old.tmp``, is still a name
    of at most :data:`~harness.base.paths.NAME_MAX` bytes."""
    room = NAME_MAX - len(os.fsencode(f"..{_OWNER}.RANDOMXX.old.tmp"))
    name = path.name
    while len(os.fsencode(name)) > room:
        name = name[:-1]
    return f".{name}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process, or no way to tell: keep
        return True
    return True


def _remove_orphans(path: Path) -> None:
    """Remove the temporary files of ``path`` left by writers on this host that have died
    (a reused pid keeps its file: the safe side). Files of other hosts on a shared folder,
    and of live writers, are left alone."""
    prefix = _temp_prefix(path)
    for tmp in path.parent.glob(f"{glob_escape(prefix)}*.tmp"):
        owner = tmp.name[len(prefix) : -len(".tmp")].rsplit(".", 1)[0]
        host, _, pid = owner.rpartition("-")
        if host == _HOST and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def remove_orphans_in(folder: Path | str) -> list[Path]:
    """Remove every temporary file in ``folder`` left by a writer on this host that has died
    (as :func:`_remove_orphans` does for one target); returns the files removed."""
    removed = []
    for tmp in Path(folder).glob(".*.tmp"):
        owner = (
            tmp.name[: -len(".tmp")].rsplit(".", 1)[0].rsplit(".", 1)[-1]
        )  # .NAME.HOST-PID.RANDOM.tmp
        host, _, pid = owner.rpartition("-")
        if host == _HOST and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def _write_error(path: Path, err: OSError) -> HarnessError:
    reason = err.strerror or str(err) or type(err).__name__
    return HarnessError(f"cannot write {path}: {reason}; the previous file (if any) is unchanged")


def publish_folder(tmp: Path, target: Path) -> None:
    """Make folder ``tmp`` (filled by the caller, in ``target``'s parent) appear as ``target``
    in one rename, after every file and folder in it is fsynced; used for generated datasets,
    whose marker file (a manifest) must never be visible before the files it lists.
    Raises ``OSError`` if ``target`` exists (another process published first)."""
    for folder, _, files in os.walk(tmp):
        for name in files:
            fd = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))
    os.rename(tmp, target)
    _fsync_dir(Path(target).parent)


@contextlib.contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """A new, empty folder beside ``target`` (``.NAME.HOST-PID.RANDOM.tmp``) for the block
    to fill. When the block ends, the folder replaces ``target`` in one rename
    (:func:`publish_folder`); an existing ``target``, which the caller has checked may go,
    is renamed aside first, put back if the rename fails, then removed. On any error,
    ``KeyboardInterrupt`` included, the staged folder is removed and ``target`` is left as
    it was: a reader sees the old folder or the whole new one, never a part."""
    target = Path(target)
    tmp = Path(
        tempfile.mkdtemp(
            prefix=f"{_temp_prefix(target)}{_OWNER}.", suffix=".tmp", dir=target.parent
        )
    )
    try:
        os.chmod(tmp, _FOLDER_MODE)  # mkdtemp's 0700: the mode any other new folder gets
        yield tmp
        if target.exists():
            aside = Path(
                tempfile.mkdtemp(
                    prefix=f"{_temp_prefix(target)}{_OWNER}.", suffix=".old.tmp", dir=target.parent
                )
            )
            os.rename(target, aside)
            try:
                publish_folder(tmp, target)
            except BaseException:
                os.rename(aside, target)
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            publish_folder(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once published


def atomic_write_set(files: dict[Path, bytes | str]) -> None:
    """Write several files as one (a table and its figures): each is written whole to a
    temporary file beside it and fsynced, then all are renamed over their targets. A
    failure while writing (a full disk) leaves every target as it was; a rename that
    fails puts back the targets already replaced (kept meanwhile as hard links) and
    removes the new ones. ``str`` contents are written as UTF-8."""
    staged: list[tuple[Path, Path]] = []  # (temporary file, target)
    try:
        for path, data in files.items():
            path = Path(path)
            _refuse_to_replace_data(path)
            payload = data.encode("utf-8") if isinstance(data, str) else data
            staged.append((_staged(path, payload), path))
        _replace_all(staged)
    finally:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
    for folder in {path.parent for _, path in staged}:
        _fsync_dir(folder)


def _staged(path: Path, data: bytes) -> Path:
    """``data`` in a new, fsynced temporary file beside ``path``; the file's path."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(path)
        fd, tmp_name = tempfile.mkstemp(
            prefix=f"{_temp_prefix(path)}{_OWNER}.", suffix=".tmp", dir=path.parent
        )
    except OSError as err:
        raise _write_error(path, err) from err
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            sync_to_disk(fh, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError):
            raise _write_error(path, err) from err
        raise
    return tmp


def _replace_all(staged: list[tuple[Path, Path]]) -> None:
    """Rename each temporary file over its target, all or none."""
    kept: list[tuple[Path, Path | None]] = []  # (target, hard link to its previous file)
    try:
        for tmp, path in staged:
            previous = None
            if path.exists():
                previous = tmp.with_name(tmp.name.removesuffix(".tmp") + ".old.tmp")
                os.link(path, previous)
            kept.append((path, previous))
            os.replace(tmp, path)
    except BaseException as err:
        for path, previous in reversed(kept):
            with contextlib.suppress(OSError):
                if previous is not None:
                    os.replace(previous, path)
                else:
                    path.unlink()
        if isinstance(err, OSError):
            raise _write_error(kept[-1][0] if kept else staged[0][1], err) from err
        raise
    finally:
        for _, previous in kept:
            if previous is not None:
                with contextlib.suppress(OSError):
                    previous.unlink()


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write(path, lambda fh: fh.write(text), binary=False)


def finite_json(data: Any) -> Any:
    """``data`` with every NaN or infinite float replaced by None: ``json.dumps`` would write
    the tokens ``NaN`` / ``Infinity``, which are not JSON. numpy / torch scalars become floats."""
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [finite_json(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if hasattr(data, "item") and getattr(data, "ndim", None) == 0:
        return finite_json(data.item())
    return data


def atomic_write_json(path: Path | str, data: Any) -> None:
    """The one JSON writer: ``data`` through :func:`finite_json`, indented, written
    atomically. ``allow_nan=False``: a non-finite value that slipped through is an error,
    never invalid JSON."""
    atomic_write_text(path, json.dumps(finite_json(data), indent=2, allow_nan=False) + "\n")


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_save_torch(
    obj: Any, path: Path | str, *, before_replace: Callable[[Path, str], Any] | None = None
) -> str:
    """``torch.save(obj)`` to ``path`` atomically; returns the sha256 of the written file.

    ``before_replace(tmp_path, sha256)``: as in :func:`atomic_write`, with the digest
    (checkpoints record it in their sidecar before the new file takes the name)."""

    digest: list[str] = []

    def check(tmp: Path) -> None:
        digest.append(sha256_file(tmp))
        if before_replace is not None:
            before_replace(tmp, digest[0])

    # deferred: torch loads only where a checkpoint is saved, not with every atomic write
    # (the command line's --help and its outputs' checks use this module)
    import torch

    def save(fh) -> None:
        try:
            torch.save(obj, fh)
        except (
            RuntimeError
        ) as err:  # torch's writer wraps the OSError of a failed write (a full disk)
            if isinstance(err.__context__, OSError):
                raise err.__context__ from err
            raise

    atomic_write(path, save, before_replace=check)
    return digest[0]
