"""The file list of a dataset given by its path, as data: each image's path, size and
label, and, when a CSV gives them, its split and its query and gallery roles.

Its hash is the dataset's fingerprint. Hashing the list rather than the pixels costs one
``stat`` per image and still changes when a file is added, removed, replaced by one of
another size, relabelled or moved to another split, which is what makes two runs'
numbers incomparable. Two lists also say what changed between them
(:meth:`FileManifest.changes_since`), so that a refusal can name it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from harness.base.errors import HarnessError

__all__ = ["ManifestRow", "FileManifest", "MANIFEST_ARTIFACT"]

#: Where a run on a dataset given by its path keeps the file list (an MLflow artifact):
#: what a grid resumed on changed files compares against to say what changed.
MANIFEST_ARTIFACT = "dataset/manifest.json"


@dataclass(frozen=True)
class ManifestRow:
    """One image: its path relative to the dataset's root (``/``-separated), its size in
    bytes and its label; ``split`` (``""`` when the class rule splits the dataset) and the
    query and gallery roles (None when the CSV has no such columns) as the CSV gives them."""

    path: str
    size: int
    label: str
    split: str = ""
    is_query: bool | None = None
    is_gallery: bool | None = None

    def as_list(self) -> list[Any]:
        return [self.path, self.size, self.label, self.split, self.is_query, self.is_gallery]

    @classmethod
    def from_list(cls, values: list[Any]) -> ManifestRow:
        path, size, label, split, is_query, is_gallery = values
        return cls(str(path), int(size), str(label), str(split), is_query, is_gallery)


@dataclass(frozen=True)
class FileManifest:
    """Every image of a dataset given by its path, sorted by path. ``source``: the folder
    or CSV file the dataset was read from (recorded, not hashed: the same files moved
    elsewhere are the same dataset)."""

    source: str
    rows: tuple[ManifestRow, ...]

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex characters of the SHA-256 of the sorted rows."""
        payload = json.dumps([row.as_list() for row in self.rows], separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(
            {
                "source": self.source,
                "fingerprint": self.fingerprint,
                "columns": ["path", "size", "label", "split", "is_query", "is_gallery"],
                "rows": [row.as_list() for row in self.rows],
            },
            indent=0,
        )

    @classmethod
    def from_json(cls, text: str) -> FileManifest:
        """A manifest written by :meth:`to_json`; anything else is one error line."""
        try:
            data = json.loads(text)
            rows = tuple(ManifestRow.from_list(values) for values in data["rows"])
            return cls(str(data["source"]), rows)
        except (ValueError, TypeError, KeyError) as err:
            raise HarnessError(f"malformed dataset manifest: {type(err).__name__}: {err}") from None

    def changes_since(self, old: FileManifest) -> str:
        """What differs from ``old``: counts of files added, removed and relabelled, and of
        files that changed size or split (the last two only when there are any). In a
        folder of class folders a file moved to another class folder is relabelled, not
        removed and added (:func:`_moved_between_classes`)."""
        before = {row.path: row for row in old.rows}
        now = {row.path: row for row in self.rows}
        both = before.keys() & now.keys()
        moved_class = _moved_between_classes(
            [before[p] for p in before.keys() - now.keys()],
            [now[p] for p in now.keys() - before.keys()],
        )
        relabelled = sum(before[p].label != now[p].label for p in both) + moved_class
        resized = sum(before[p].size != now[p].size for p in both)
        moved = sum(before[p].as_list()[3:] != now[p].as_list()[3:] for p in both)
        parts = [
            f"{_files(len(now.keys() - before.keys()) - moved_class)} added",
            f"{len(before.keys() - now.keys()) - moved_class} removed",
            f"{relabelled} relabelled",
        ]
        if resized:
            parts.append(f"{resized} changed in size")
        if moved:
            parts.append(f"{moved} moved to another split or query/gallery role")
        return ", ".join(parts)


def _in_class_folder(row: ManifestRow) -> tuple[str, int] | None:
    """``(path below the class folder, size)`` of a row whose path starts with its label's
    folder (a folder of class folders); None for any other row."""
    folder, _, rest = row.path.partition("/")
    return (rest, row.size) if folder == row.label and rest else None


def _moved_between_classes(removed: list[ManifestRow], added: list[ManifestRow]) -> int:
    """How many removed files came back, same name and size, under another class folder."""
    gone: dict[tuple[str, int], int] = {}
    for row in removed:
        if (key := _in_class_folder(row)) is not None:
            gone[key] = gone.get(key, 0) + 1
    found = 0
    for row in added:
        key = _in_class_folder(row)
        if key is not None and gone.get(key, 0) > 0:
            gone[key] -= 1
            found += 1
    return found


def _files(count: int) -> str:
    return f"{count} file{'' if count == 1 else 's'}"
