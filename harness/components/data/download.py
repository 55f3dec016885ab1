"""A resumable download of one file of a dataset's release (HTTP Range requests): what a
transfer that broke off after some bytes leaves (``.<file>.<url hash>.part`` in the data
root) is resumed by the next one; any other failure leaves nothing. Verifying and
unpacking it are :mod:`harness.components.data.fetch`'s."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from harness.base.errors import HarnessError

__all__ = ["DEFAULT_TIMEOUT", "download"]

#: Seconds a connection may stay silent (connect, or between two reads) before the fetch stops.
DEFAULT_TIMEOUT = 60.0
_BLOCK = 1 << 20


@dataclass(frozen=True)
class _Part:
    """The file being downloaded: its URL and its name in the release."""

    url: str
    filename: str


def _part_path(url: str, filename: str, root: Path) -> Path:
    """The download's file in the data root, named after the URL so another source never resumes it."""
    tag = hashlib.sha256(url.encode()).hexdigest()[:10]
    return root / f".{filename}.{tag}.part"


def download(
    url: str,
    filename: str,
    root: Path,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    progress: bool = False,
    say: Callable[[str], None] = print,
) -> Path:
    """Download ``url`` (the release's ``filename``) into its ``.part`` file under ``root``,
    resuming one left by a transfer that broke off; returns that file."""
    part = _Part(url, filename)
    path = _part_path(url, filename, root)
    have = path.stat().st_size if path.exists() else 0
    request = urllib.request.Request(part.url, headers={"User-Agent": "dml-harness"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and have:  # the part is already whole: the checksum decides
            return path
        _drop_empty(path)
        raise HarnessError(f"downloading {part.url} failed: HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError) as err:
        _drop_empty(path)
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError):
            raise HarnessError(f"{part.url} did not answer within {timeout:g} s") from None
        raise HarnessError(f"cannot reach {part.url}: {reason}") from None
    with response:
        resumed = have and response.status == 206 and _range_start(response) == have
        if have and not resumed:
            have = 0  # the server sent the whole file again
        if have:
            say(f"{part.filename}: resuming at {have:,} bytes")
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else None
        got = _copy(response, part, path, start=have, total=total, progress=progress)
    if total is not None and got < total:
        raise _broke_off(part, path, got, total, "the connection closed")
    return path


def _range_start(response) -> int | None:
    value = response.headers.get("Content-Range", "")  # "bytes 100-199/200"
    start = value.removeprefix("bytes ").split("-", 1)[0]
    return int(start) if start.isdigit() else None


def _copy(
    response, part: _Part, path: Path, *, start: int, total: int | None, progress: bool
) -> int:
    """Stream the body to ``path``; returns the file's size. A stall or a dropped connection
    keeps what arrived (when anything did) for the next fetch to resume."""

    got = start
    bar = tqdm(
        total=total,
        initial=start,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=part.filename,
        disable=not progress,
        leave=False,
    )
    try:
        with bar, open(path, "ab" if start else "wb") as out:
            while block := response.read(_BLOCK):
                out.write(block)
                got += len(block)
                bar.update(len(block))
    except (TimeoutError, http.client.IncompleteRead, ConnectionError) as err:
        got = path.stat().st_size
        if got == 0:
            path.unlink()
        why = "no data arrived in time" if isinstance(err, TimeoutError) else "the connection broke"
        raise _broke_off(part, path, got, total, why) from None
    return got


def _broke_off(part: _Part, path: Path, got: int, total: int | None, why: str) -> HarnessError:
    if not path.exists() or got == 0:
        _drop_empty(path)
        return HarnessError(f"downloading {part.url} failed: {why} before any data")
    of = f" of {total:,}" if total else ""
    return HarnessError(
        f"downloading {part.filename} stopped ({why}) at {got:,}{of} bytes; kept in {path}: "
        f"run the same command again to resume"
    )


def _drop_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            path.unlink()
