"""Your own images as a dataset, named on the command line by its path (``--dataset
./my_images``, ``--dataset products.csv``): a folder of class folders or a CSV in
open-metric-learning's columns (:mod:`harness.components.data.own_files` reads both).
:func:`dataset_name` registers it under a short name (``--dataset-name``, else the
folder's or the CSV's name), so that every command, table and MLflow run names it as it
names a built-in dataset.

Splits, class-disjoint as the field's benchmarks:

* A CSV's ``split`` column is used as given: ``train`` rows train, ``test`` rows test,
  ``validation`` rows select the model. A CSV with ``validation`` rows and no ``test``
  rows is open-metric-learning's own layout, where ``validation`` is what it evaluates
  on: those rows are then the test split.
* Otherwise (a folder, or a CSV without ``split``) the classes sorted by name
  (numerically when every name is an integer) are cut in two: the first half, rounded
  up, trains and the rest tests, as CUB (classes 1-100 of 200) and Cars (1-98 of 196) do.
  The rule has no seed: the same files always give the same split.
* Unless the CSV gives ``validation`` rows, the protocol carves its validation classes
  from the training classes with its seed (:func:`~harness.components.data.carve_validation`),
  as for every dataset. A label in two splits is an error, and each split needs two
  classes at least.

``is_query`` / ``is_gallery`` split the test rows into queries searched against a
gallery, as In-Shop's are. A test row that is both is allowed only when every test row
is: the test set is then searched against itself, each query without itself.

Images are read as their owners' viewers show them (:func:`as_rgb`): EXIF orientation
applied, every mode converted to RGB.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from harness.base.errors import HarnessError, unknown_name
from harness.components.data.base import DATASETS, DatasetInfo, DatasetSplits, FileImageSet
from harness.components.data.manifest import FileManifest, ManifestRow
from harness.components.data.own_files import read_csv, scan_folder

__all__ = [
    "UserImageSet",
    "OwnData",
    "OwnDatasetInfo",
    "as_rgb",
    "class_order",
    "assign_splits",
    "looks_like_path",
    "dataset_name",
    "register_path",
    "dataset_manifest",
    "MIN_CLASSES",
]

#: Classes each split needs: one class alone makes every retrieval metric trivially perfect.
MIN_CLASSES = 2
#: Image modes of more than 8 bits per pixel (16-bit PNG and TIFF grayscale).
_WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")
_WHITE = (255, 255, 255, 255)


def as_rgb(image: Image.Image) -> Image.Image:
    """``image`` as its owner's viewer shows it, in RGB: turned by its EXIF orientation
    (phones store pictures unturned with a tag saying how to turn them), transparent
    pixels laid over white (a transparent pixel's colour values are arbitrary, often
    black), 16-bit grayscale scaled to 8 bits, and palette, grayscale or CMYK converted."""
    image = ImageOps.exif_transpose(image)
    if image.mode in _WIDE_MODES:
        scaled = np.asarray(image, dtype=np.float64) / 257.0
        image = Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    return image.convert("RGB")


class UserImageSet(FileImageSet):
    """The images of a dataset given by its path, read through :func:`as_rgb` (the
    built-in benchmarks keep the field's plain ``convert("RGB")``, under which their
    published numbers were measured)."""

    def read(self, index: int) -> Image.Image:
        path = self.root / self.relpaths[index]
        try:
            with Image.open(path) as img:
                return as_rgb(img)
        except FileNotFoundError:
            raise HarnessError(f"image listed by the dataset is missing: {path}") from None
        except Exception as err:  # PIL raises several types for broken files
            raise HarnessError(f"corrupt image {path}: {type(err).__name__}: {err}") from None

    def subset(self, indices: np.ndarray) -> UserImageSet:
        return UserImageSet(self.root, [self.relpaths[i] for i in indices], self.labels[indices])


def class_order(labels: Iterable[str]) -> list[str]:
    """The distinct labels sorted by name, numerically when every one is an integer (so
    that class 10 follows class 9, as CUB's and Cars' numbered classes do)."""
    names = set(labels)
    if all(re.fullmatch(r"[+-]?\d+", name) for name in names):
        return sorted(names, key=int)
    return sorted(names)


def _classes(count: int) -> str:
    return f"{count} class{'' if count == 1 else 'es'}"


def _check_classes(split: str, rows: Sequence[ManifestRow], source: Path) -> None:
    labels = class_order(r.label for r in rows)
    if len(labels) < MIN_CLASSES:
        raise HarnessError(
            f"dataset {source}: the {split} split holds {_classes(len(labels))} "
            f"({', '.join(map(repr, labels)) or 'no image'}); each split needs at least {MIN_CLASSES}"
        )


def _check_pairs(split: str, rows: Sequence[ManifestRow], source: Path) -> None:
    """A split in which every class holds one image has no pair of images of a class: no
    positive to train on, no match for a query to retrieve."""
    if len({r.label for r in rows}) == len(rows):
        raise HarnessError(
            f"dataset {source}: every class of the {split} split holds one image; expected "
            f"at least one class with 2 images or more (a pair of one class to learn from, "
            f"or to retrieve)"
        )


def _check_disjoint(parts: dict[str, list[ManifestRow]], source: Path) -> None:
    """A label in two of the given splits is an error naming it and an image of each."""
    seen: dict[str, tuple[str, ManifestRow]] = {}
    for split, rows in parts.items():
        for row in rows:
            other = seen.setdefault(row.label, (split, row))
            if other[0] != split:
                raise HarnessError(
                    f"dataset {source}: label {row.label!r} is in both the {other[0]} and the "
                    f"{split} rows ({other[1].path}, {row.path}); splits must be class-disjoint "
                    f"(zero-shot retrieval tests on classes it did not train on)"
                )


def _given_splits(rows: list[ManifestRow], source: Path) -> dict[str, list[ManifestRow]]:
    """The CSV's ``split`` column: train, validation (maybe empty) and test rows."""
    by = {value: [r for r in rows if r.split == value] for value in ("train", "validation", "test")}
    if not by["test"]:  # open-metric-learning's layout: "validation" is its evaluation split
        by["test"], by["validation"] = by["validation"], []
    if not by["train"]:
        raise HarnessError(f"dataset {source}: no row with split 'train'")
    if not by["test"]:
        raise HarnessError(
            f"dataset {source}: no row with split 'test' (or 'validation', the test split of "
            f"a CSV without 'test' rows)"
        )
    _check_disjoint({k: v for k, v in by.items() if v}, source)
    return {"train": by["train"], "val": by["validation"], "test": by["test"]}


def _class_rule(rows: list[ManifestRow], source: Path) -> dict[str, list[ManifestRow]]:
    """The first half of the classes by name (rounded up) trains, the rest tests."""
    order = class_order(r.label for r in rows)
    if len(order) < 2 * MIN_CLASSES:
        raise HarnessError(
            f"dataset {source} holds {_classes(len(order))} ({', '.join(map(repr, order))}); "
            f"the class-disjoint split needs at least {2 * MIN_CLASSES} "
            f"({MIN_CLASSES} to train on, {MIN_CLASSES} to test on)"
        )
    train = set(order[: (len(order) + 1) // 2])
    return {
        "train": [r for r in rows if r.label in train],
        "val": [],
        "test": [r for r in rows if r.label not in train],
    }


def _query_gallery(
    parts: dict[str, list[ManifestRow]], source: Path
) -> dict[str, list[ManifestRow]]:
    """The test rows as queries and gallery when the CSV gives their roles."""
    test = parts["test"]
    parts["gallery"] = []
    if all(r.is_query is None and r.is_gallery is None for r in test):
        return parts
    for row in test:
        if row.is_query is None or row.is_gallery is None:
            raise HarnessError(
                f"dataset {source}: test image {row.path} has no is_query or is_gallery value; "
                f"give both for every test row"
            )
        if not row.is_query and not row.is_gallery:
            raise HarnessError(
                f"dataset {source}: test image {row.path} is neither a query nor a gallery image"
            )
    both = [r for r in test if r.is_query and r.is_gallery]
    if len(both) == len(test):  # every test image is both: the set searched against itself
        return parts
    if both:
        raise HarnessError(
            f"dataset {source}: test image {both[0].path} is both a query and a gallery image, "
            f"other test images one of the two; give every test image one role (queries "
            f"searched against a gallery), or every one both (the test set searched against itself)"
        )
    parts["test"] = [r for r in test if r.is_query]
    parts["gallery"] = [r for r in test if r.is_gallery]
    return parts


def assign_splits(rows: list[ManifestRow], source: Path) -> dict[str, list[ManifestRow]]:
    """``{"train", "val", "test", "gallery"}`` -> rows (``val`` and ``gallery`` maybe
    empty), by the rules of this module's docstring; each split checked."""
    given = any(r.split for r in rows)
    parts = _query_gallery(
        _given_splits(rows, source) if given else _class_rule(rows, source), source
    )
    _check_classes("training", parts["train"], source)
    if parts["val"]:
        _check_classes("validation", parts["val"], source)
    _check_classes("test", parts["test"] + parts["gallery"], source)
    _check_pairs("training", parts["train"], source)
    if not parts["gallery"]:  # queries searched against the test split itself
        _check_pairs("test", parts["test"], source)
    return parts


@dataclass(frozen=True, eq=False)
class OwnData:
    """A dataset given by its path, read and split: ``source`` is the folder or CSV file,
    ``root`` the folder the rows' paths are relative to."""

    name: str
    source: Path
    root: Path
    manifest: FileManifest
    parts: dict[str, list[ManifestRow]]

    def splits(self) -> DatasetSplits:
        """Fresh splits (the harness carves and caps them in place); labels are the
        classes' positions in :func:`class_order`."""
        index = {
            label: i for i, label in enumerate(class_order(r.label for r in self.manifest.rows))
        }

        def images(rows: list[ManifestRow]) -> UserImageSet:
            return UserImageSet(self.root, [r.path for r in rows], [index[r.label] for r in rows])

        return DatasetSplits(
            self.name,
            train=images(self.parts["train"]),
            test=images(self.parts["test"]),
            val=images(self.parts["val"]) if self.parts["val"] else None,
            gallery=images(self.parts["gallery"]) if self.parts["gallery"] else None,
            files=self.manifest,
            val_given=bool(self.parts["val"]),
        )


@dataclass(frozen=True)
class OwnDatasetInfo(DatasetInfo):
    """The registry entry of a dataset given by its path: found where the path says,
    whatever ``--data-root`` is."""

    data: OwnData = field(kw_only=True)

    def locate(self, data_root: Path | None) -> Path:
        return self.data.root

    def argument(self) -> str:
        return str(self.data.source)


def looks_like_path(text: str) -> bool:
    """Whether ``--dataset``'s value is a path whatever is on disk: it holds a path
    separator or names a ``.csv`` file."""
    return "/" in text or "\\" in text or text.lower().endswith(".csv")


def _builtin_names() -> list[str]:
    return [n for n in DATASETS.list() if not isinstance(DATASETS.get(n), OwnDatasetInfo)]


def dataset_name(text: str, *, name: str | None = None, base: Path | None = None) -> str:
    """The registered name ``text`` stands for (``--dataset``'s value, an entry of a grid's
    ``datasets``): a built-in name as it is; a path (:func:`looks_like_path`, or an existing
    folder) read, split and registered under ``name`` or its own name. A relative path is
    taken from ``base`` (a grid's folder), else the working directory."""
    path = (base or Path()) / Path(text).expanduser()
    if not looks_like_path(text):
        if text in _builtin_names():
            if name is not None:
                raise HarnessError(
                    f"--dataset-name names a dataset given by its path; '{text}' is a built-in dataset"
                )
            return text
        if not path.is_dir():
            err = unknown_name("dataset", text, _builtin_names())
            raise HarnessError(f"{err} (or your own dataset's folder or .csv file, by its path)")
    if not path.exists():
        raise HarnessError(
            f"dataset {path} does not exist: expected a folder of class folders or a .csv file"
        )
    return register_path(path, name)


def _read(path: Path) -> tuple[Path, list[ManifestRow]]:
    """(the folder the paths are relative to, the rows) of a folder or a CSV file."""
    if path.is_dir():
        rows, skipped = scan_folder(path)
        if skipped:
            print(
                f"dataset {path}: {len(skipped)} file(s) without an image suffix left out "
                f"(e.g. {skipped[0]})",
                file=sys.stderr,
            )
        return path, rows
    if path.suffix.lower() != ".csv":
        raise HarnessError(
            f"dataset {path} is a file but not a .csv: expected a folder of class folders or a .csv file"
        )
    return path.parent, read_csv(path)


def register_path(path: Path, name: str | None = None) -> str:
    """Read the dataset at ``path``, split it, register it under ``name`` (else the
    folder's name or the CSV's stem) and return the name. A name registered by an earlier
    path in this process is replaced; a built-in dataset's name is refused."""
    source = Path(os.path.abspath(path))  # '..' folded, symbolic links kept as given
    root, rows = _read(source)
    name = name if name is not None else (source.name if source.is_dir() else source.stem)
    if name in _builtin_names():
        raise HarnessError(
            f"dataset {path} would be named '{name}', a built-in dataset's name; "
            f"give it another with --dataset-name"
        )
    manifest = FileManifest(str(source), tuple(sorted(rows, key=lambda r: r.path)))
    data = OwnData(name, source, root, manifest, assign_splits(list(manifest.rows), source))
    if name in DATASETS:
        DATASETS.remove(name)
    DATASETS.register(name)(
        OwnDatasetInfo(
            name,
            f"your own images ({source})",
            folder="",
            marker="",
            loader=lambda _root: data.splits(),
            train_classes=lambda _root: len({r.label for r in data.parts["train"]}),
            val_given=bool(data.parts["val"]),
            data=data,
        )
    )
    return name


def dataset_manifest(name: str) -> FileManifest | None:
    """The file list of registered dataset ``name`` when it was given by its path (None
    for a built-in one)."""
    info = DATASETS.get(name)
    return info.data.manifest if isinstance(info, OwnDatasetInfo) else None
