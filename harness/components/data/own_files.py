"""The two shapes a user's images come in, read into a :class:`FileManifest`'s rows.

* A folder of class folders, torchvision's ``ImageFolder`` layout: ``ROOT/<class>/...``,
  one sub-folder per class, images at any depth below it. Files whose suffix is not an
  image format Pillow reads (a ``notes.txt``) are left out and counted; hidden files and
  folders (a name starting with ``.``, such as the verified stamp or ``.DS_Store``) and
  files directly in ``ROOT`` are not images of a class and are passed over.
* A CSV with open-metric-learning's column names: ``label`` and ``path`` (relative to
  the CSV's folder), optionally ``split`` (``train``, ``validation``, ``test``) and
  ``is_query`` / ``is_gallery``; other columns (``category``, bounding boxes) are not used.

Everything that would make the dataset ambiguous is one error line naming the file, the
row and the value: a missing column, an empty path or label, a path outside the CSV's
folder, a path listed twice, a split or role value that is not one of the documented ones,
a listed image that is not there.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path, PurePosixPath

from PIL import Image

from harness.base.errors import HarnessError
from harness.base.paths import read_text
from harness.components.data.manifest import ManifestRow

__all__ = ["IMAGE_SUFFIXES", "SPLIT_VALUES", "scan_folder", "read_csv", "shown_path"]

#: File suffixes of the image formats this Pillow reads (``.jpg``, ``.png``, ``.webp``...).
IMAGE_SUFFIXES = frozenset(Image.registered_extensions())
#: The values of a CSV's ``split`` column.
SPLIT_VALUES = ("train", "validation", "test")
_TRUE, _FALSE = {"1", "1.0", "true", "yes"}, {"0", "0.0", "false", "no"}


def _size(path: Path, where: str) -> int:
    """The file's size in bytes; a file that is not there is an error naming ``where``."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise HarnessError(f"image listed by {where} is missing: {path}") from None
    except OSError as err:  # a symlink loop, a folder without permission
        raise HarnessError(
            f"image {path} ({where}) cannot be read: {err.strerror or err}"
        ) from None


def scan_folder(root: Path) -> tuple[list[ManifestRow], list[str]]:
    """Rows of every image under ``root``'s class folders (label: the folder's name) and
    the paths of the files left out for their suffix. A folder without class folders, or
    with a class folder that holds no image, is an error naming it."""
    try:
        entries = sorted(root.iterdir())
    except OSError as err:
        raise HarnessError(f"dataset folder {root} cannot be read: {err.strerror or err}") from None
    classes = [e for e in entries if e.is_dir() and not e.name.startswith(".")]
    for folder in classes:
        _check_name(folder, root)
    if not classes:
        what = "is empty" if not entries else "holds no class folder"
        raise HarnessError(
            f"dataset folder {root} {what}: expected one sub-folder of images per class "
            f"(ROOT/<class>/<image>), or a .csv file"
        )
    rows: list[ManifestRow] = []
    skipped: list[str] = []
    for folder in classes:
        found = len(rows)
        for path in _files_below(folder):
            _check_name(path, root)
            relpath = path.relative_to(root).as_posix()
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                skipped.append(relpath)
                continue
            rows.append(ManifestRow(relpath, _size(path, f"folder {root}"), folder.name))
        if len(rows) == found:
            raise HarnessError(
                f"class folder {folder} holds no image (expected files such as .jpg, .png, "
                f".webp); remove it or add its images"
            )
    return rows, skipped


def shown_path(path: Path) -> str:
    """``path`` as text an error line can print: bytes that are not UTF-8 as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _check_name(path: Path, root: Path) -> None:
    """A path below ``root`` that is not UTF-8 (the manifest, the fingerprint and the
    tracking store hold paths as UTF-8 text) is an error naming it."""
    try:
        path.relative_to(root).as_posix().encode("utf-8")
    except UnicodeEncodeError:
        kind = "folder" if path.is_dir() else "file"
        raise HarnessError(
            f"dataset folder {root}: the {kind} name {shown_path(path)} is not UTF-8; "
            f"expected UTF-8 names (rename it)"
        ) from None


def _files_below(folder: Path) -> list[Path]:
    """Every file below ``folder``, hidden ones and hidden folders left out, in name
    order (symbolic links to folders are not followed: a link back up would loop)."""
    found = []
    for current, folders, files in os.walk(folder):
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        found += [Path(current) / f for f in sorted(files) if not f.startswith(".")]
    return found


def _columns(reader: csv.DictReader, csv_path: Path) -> list[str]:
    columns = [c.strip() for c in (reader.fieldnames or [])]
    for name in ("label", "path", "split", "is_query", "is_gallery"):
        where = [str(i + 1) for i, column in enumerate(columns) if column == name]
        if len(where) > 1:
            raise HarnessError(
                f"{csv_path}: column '{name}' appears {len(where)} times (columns "
                f"{', '.join(where)}); expected each column once"
            )
    for needed in ("label", "path"):
        if needed not in columns:
            raise HarnessError(
                f"{csv_path}: missing column '{needed}' (columns: {', '.join(columns) or 'none'}); "
                f"expected open-metric-learning's label, path[, split, is_query, is_gallery]"
            )
    roles = [c for c in ("is_query", "is_gallery") if c in columns]
    if len(roles) == 1:
        raise HarnessError(
            f"{csv_path}: column '{roles[0]}' without its pair; give both is_query and is_gallery"
        )
    reader.fieldnames = columns
    return columns


def _relative_path(text: str, where: str) -> str:
    """``text`` as a ``/``-separated path inside the CSV's folder (``./`` dropped); an
    empty, absolute or escaping (``..``) one is an error naming ``where``."""
    if not text.strip():
        raise HarnessError(f"{where}: empty path")
    if "\0" in text:
        raise HarnessError(
            f"{where}: path {text!r} holds a NUL byte; expected a file name without one"
        )
    path = PurePosixPath(text)
    if path.is_absolute():
        raise HarnessError(f"{where}: path {text!r} is absolute; expected one relative to the CSV")
    if ".." in path.parts:
        raise HarnessError(
            f"{where}: path {text!r} escapes the CSV's folder through '..'; expected a path "
            f"inside it"
        )
    return path.as_posix()


def _role(value: str | None, column: str, where: str) -> bool | None:
    text = (value or "").strip().lower()
    if not text:
        return None
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise HarnessError(f"{where}: {column} {value!r}: expected true or false (or 1 or 0)")


def _row(record: dict[str, str | None], columns: list[str], root: Path, where: str) -> ManifestRow:
    """One CSV row as a manifest row, every value checked."""
    relpath = _relative_path(record["path"] or "", where)
    label = (record["label"] or "").strip()
    if not label:
        raise HarnessError(f"{where}: empty label")
    split = ""
    if "split" in columns:
        split = (record["split"] or "").strip()
        if split not in SPLIT_VALUES:
            raise HarnessError(
                f"{where}: split {record['split']!r}: expected one of {', '.join(SPLIT_VALUES)}"
            )
    roles = [
        _role(record.get(c), c, where) if c in columns else None for c in ("is_query", "is_gallery")
    ]
    return ManifestRow(relpath, _size(root / relpath, where), label, split, *roles)


def read_csv(csv_path: Path) -> list[ManifestRow]:
    """The rows of ``csv_path`` (paths relative to its folder), each checked; a path listed
    twice is an error naming both rows (and both labels when they differ)."""
    text = read_text(csv_path, "CSV").removeprefix("\ufeff")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        columns = _columns(reader, csv_path)
        rows: list[ManifestRow] = []
        first: dict[str, tuple[int, str]] = {}
        for record in reader:
            where = f"{csv_path}, row {reader.line_num}"
            row = _row(record, columns, csv_path.parent, where)
            if row.path in first:
                line, label = first[row.path]
                labels = f" with two labels, {label!r} (row {line}) and {row.label!r}"
                raise HarnessError(
                    f"{where}: path {row.path!r} is listed again"
                    + (labels if label != row.label else f" (row {line})")
                )
            first[row.path] = (reader.line_num, row.label)
            rows.append(row)
    except csv.Error as err:
        raise HarnessError(f"{csv_path}, row {reader.line_num}: malformed CSV: {err}") from None
    if not rows:
        raise HarnessError(f"{csv_path} lists no image (a header and no row)")
    return rows
