"""Every image of a dataset readable before training starts, not found broken mid-run.

Decoding every image of SOP takes minutes, so it is done once, by
``python -m harness datasets verify NAME`` (:func:`verify_images`), which leaves a stamp
in the dataset's folder (:data:`STAMP`). The stamp holds a digest of the image list with
each file's size and modification time: a file added, removed, replaced or touched since
makes it stale. ``run`` checks the stamp (:func:`check_images`); a tree without a current
one gets a header check instead (each file opened and its format and size read, no pixel
decoded; a JPEG or PNG without its end marker is decoded in full), which finds missing, empty,
truncated and non-image files in seconds, and one line says how to verify fully.

Images the harness generates itself (the embedded synthetic set, packed into one array)
and datasets held as arrays (Fashion-MNIST) have no image files and nothing to check here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from harness.base.atomic import atomic_write_json
from harness.base.errors import HarnessError
from harness.components.data.base import DATASETS, DatasetSplits, FileImageSet

__all__ = [
    "STAMP",
    "dataset_images",
    "tree_digest",
    "stamp_is_current",
    "check_headers",
    "verify_images",
    "check_images",
    "verify_command",
    "verify_dataset",
]

#: The verified stamp, in the dataset's folder.
STAMP = ".harness-verified.json"


def dataset_images(splits: DatasetSplits) -> list[Path]:
    """Every image file the splits list, once each, in a stable order."""
    seen: dict[Path, None] = {}
    for split in (splits.train, splits.val, splits.test, splits.gallery):
        if isinstance(split, FileImageSet):
            seen.update((split.root / rel, None) for rel in split.relpaths)
    return list(seen)


def tree_digest(root: Path, files: list[Path]) -> str:
    """A digest of each file's path (relative to ``root``), size and modification time;
    a listed file that is missing is an error naming it."""
    digest = hashlib.sha256()
    for path in files:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise HarnessError(f"image listed by the dataset is missing: {path}") from None
        except OSError as err:  # a symlink loop, a folder without permission
            raise HarnessError(f"broken image {path}: {err.strerror or err}") from None
        digest.update(f"{os.path.relpath(path, root)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def stamp_is_current(root: Path, digest: str) -> bool:
    """Whether ``root`` holds a verified stamp for exactly this tree."""
    try:
        stamp = json.loads((root / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp.get("digest") == digest


#: The end a complete file of each format ends with (a JPEG's end-of-image marker, a
#: PNG's IEND chunk), looked for within :data:`END_WITHIN` bytes of the end of the file
#: (some writers pad the file after it).
FORMAT_ENDS = {"JPEG": b"\xff\xd9", "PNG": b"IEND\xaeB`\x82"}
END_WITHIN = 4096


def _header_problem(path: Path) -> str | None:
    """Why ``path`` is not an image PIL can read the header of (None when it is). A JPEG
    or PNG without its end (:data:`FORMAT_ENDS`) near the end of the file (cut short by a
    copy or a download) is decoded in full to tell."""
    try:
        with Image.open(path) as img:
            width, height = img.size
            end = FORMAT_ENDS.get(img.format or "")
            if end is not None and not _ends_with(path, end):
                img.load()
    except FileNotFoundError:
        return "missing"
    except Exception as err:  # PIL raises several types for broken files
        return f"{type(err).__name__}: {err}"
    return None if width > 0 and height > 0 else f"size {width}x{height}"


def _ends_with(path: Path, end: bytes) -> bool:
    with open(path, "rb") as fh:
        fh.seek(max(0, fh.seek(0, os.SEEK_END) - END_WITHIN))
        return end in fh.read()


def _decode_problem(path: Path) -> str | None:
    """Why ``path`` cannot be decoded in full (None when it can)."""
    try:
        with Image.open(path) as img:
            img.load()
    except FileNotFoundError:
        return "missing"
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def check_headers(files: list[Path]) -> None:
    """Open every file and read its image header (no pixel decoded); the first that fails
    is one error line naming its path."""
    for path in files:
        if (problem := _header_problem(path)) is not None:
            raise HarnessError(
                f"corrupt image {path}: {problem} (found by the header check before training)"
            )


def verify_images(
    files: list[Path], *, threads: int = 4, progress: bool = False
) -> list[tuple[Path, str]]:
    """Decode every file once (in threads: PIL releases the GIL while decoding); returns
    ``(path, why)`` of each that failed, in the files' order."""

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        problems = list(
            tqdm(
                pool.map(_decode_problem, files),
                total=len(files),
                unit="img",
                desc="decoding",
                disable=not progress,
                leave=False,
            )
        )
    return [(path, why) for path, why in zip(files, problems, strict=True) if why is not None]


def _listed_images(name: str, data_root: Path | None) -> tuple[Path, list[Path]] | None:
    """(dataset folder, its image files) from the dataset's own index files, or None for
    a dataset without image files. Index files that are missing or inconsistent are the
    loader's error line."""
    info = DATASETS.get(name)
    if info.embedded:
        return None
    root = info.locate(data_root)
    files = dataset_images(info.loader(root))
    return (root, files) if files else None


def verify_command(name: str, data_root: Path | None) -> str:
    """The command that verifies ``name`` (a dataset given by its path: by that path)."""
    info = DATASETS.get(name)
    root = f" --data-root {data_root}" if data_root and info.argument() == name else ""
    return f"python -m harness datasets verify {shlex.quote(info.argument())}{root}"


def verify_dataset(
    name: str,
    data_root: Path | None,
    *,
    threads: int = 4,
    progress: bool = False,
    say: Callable[[str], None] = print,
) -> Path | None:
    """``datasets verify``: decode every image of ``name``; on success write the stamp
    (atomically) and return its path; a broken image is one error line naming it (and how
    many others failed). None for a dataset without image files."""
    listed = _listed_images(name, data_root)
    if listed is None:
        say(
            f"dataset '{name}' has no image files to verify (its images are generated or held as arrays)"
        )
        return None
    root, files = listed
    digest = tree_digest(root, files)
    problems = verify_images(files, threads=threads, progress=progress)
    if problems:
        path, why = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise HarnessError(f"corrupt image {path}: {why}{more}; dataset '{name}' not verified")
    atomic_write_json(root / STAMP, {"dataset": name, "images": len(files), "digest": digest})
    say(f"dataset '{name}': {len(files):,} images decoded, all readable; stamp {root / STAMP}")
    return root / STAMP


def check_images(name: str, data_root: Path | None, *, say: Callable[[str], None] = print) -> None:
    """Before training: a dataset verified since its last change passes at once; any
    other gets the header check of every image and one line saying how to verify fully."""
    listed = _listed_images(name, data_root)
    if listed is None:
        return
    root, files = listed
    if stamp_is_current(root, tree_digest(root, files)):
        return
    check_headers(files)
    say(
        f"dataset '{name}': {len(files):,} image headers checked, pixels not decoded; to decode each "
        f"image once and record it: {verify_command(name, data_root)}"
    )
