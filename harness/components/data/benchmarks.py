"""The four standard DML benchmarks, read from their official layouts.

Splits are the community's zero-shot, class-disjoint ones, introduced by Oh Song et al.
2016 ("Deep Metric Learning via Lifted Structured Feature Embedding", CVPR) for CUB,
Cars and SOP and by Liu et al. 2016 ("DeepFashion", CVPR) for In-Shop, and restated with
their counts by the seed papers: DIML Sec. 4.1, A-grouping Sec. 4.1, AVSL Sec. 4.1, DIABLO
Sec. 5 (the only one with In-Shop).

* CUB-200-2011 (Wah et al. 2011, Caltech tech. report CNS-TR-2011-001; the release's
  README documents ``images.txt`` and ``image_class_labels.txt``): 11,788 images of 200
  classes; classes 1-100 train (5,864 images), 101-200 test (5,924).
* Cars196 (Krause et al. 2013, "3D Object Representations for Fine-Grained
  Categorization", 3dRR; ``cars_annos.mat`` of the devkit, fields ``relative_im_path``,
  ``class``, ``test``): 16,185 images of 196 classes; classes 1-98 train (8,054), 99-196
  test (8,131); the annotation's ``test`` flag (a within-class split for classification)
  is ignored.
* SOP (Oh Song et al. 2016; the release's README documents ``Ebay_train.txt`` /
  ``Ebay_test.txt``, header ``image_id class_id super_class_id path``): 120,053 images
  of 22,634 classes; 59,551 train images of 11,318 classes, 60,502 test of 11,316.
* In-Shop (Liu et al. 2016; the benchmark's README documents
  ``Eval/list_eval_partition.txt``: a count, the header ``image_name item_id
  evaluation_status``, rows train / query / gallery): 52,712 images of 7,982 items;
  25,882 train images of 3,997 items, 14,218 query and 12,612 gallery images of 3,985
  items; test = query searched against gallery. (DIABLO Sec. 5 prints "17218" query
  images, a typo: 25,882 + 14,218 + 12,612 = 52,712.)

:func:`~harness.components.data.base.check_official_counts` holds a full tree to these counts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy.io import loadmat

from harness.base.errors import HarnessError
from harness.components.data.base import (
    DatasetSplits,
    FileImageSet,
    OfficialCounts,
    register_dataset,
)


def _index_file(path: Path) -> Path:
    """An index file of the release that must be there: its absence is one error line."""
    if not path.is_file():
        raise HarnessError(f"dataset incomplete: expected the index file {path}")
    return path


def _labels(values: list[str], path: Path) -> np.ndarray:
    """Class ids read from ``path`` as integers; one that is not is an error naming the file."""
    try:
        return np.array([int(v) for v in values], dtype=np.int64)
    except ValueError as err:
        raise HarnessError(f"malformed class id in {path}: {err}") from None


def _read_columns(
    path: Path, columns: tuple[int, ...], *, skip: int = 0, min_fields: int = 2
) -> list[list[str]]:
    """The ``columns`` of ``path``'s whitespace-separated rows after ``skip`` header lines,
    one list per column. Only the wanted strings are kept, never a list per row: 120,000
    rows of lists (SOP) would set off full passes of the cyclic garbage collector, which
    cost more than reading the file."""
    kept: list[list[str]] = [[] for _ in columns]
    with open(_index_file(path), encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if lineno <= skip or not line.strip():
                continue
            fields = line.split()
            if len(fields) < min_fields:
                raise HarnessError(f"malformed line {lineno} in {path}: {line.strip()!r}")
            for values, column in zip(kept, columns, strict=True):
                values.append(fields[column])
    return kept


def _id_table(path: Path, value: str) -> dict[str, str]:
    """The rows ``<image id> <value>`` of a CUB index file, by id: the value is the rest of
    the line (a path may hold spaces). An id that is not an integer, a class id that is
    not one, or an id given again with another value is an error naming the file and line."""
    table: dict[str, str] = {}
    first: dict[str, int] = {}
    with open(_index_file(path), encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            fields = line.strip().split(maxsplit=1)
            if not fields:
                continue
            if len(fields) < 2:
                raise HarnessError(
                    f"{path}:{lineno}: malformed line {line.strip()!r}: expected '<image id> <{value}>'"
                )
            if not fields[0].isdigit():
                raise HarnessError(
                    f"{path}:{lineno}: image id {fields[0]!r} is not an integer >= 0"
                )
            image_id, rest = str(int(fields[0])), fields[1]
            if value == "class id" and not rest.isdigit():
                raise HarnessError(
                    f"{path}:{lineno}: malformed class id {rest!r}: expected an integer >= 1"
                )
            if image_id in table and table[image_id] != rest:
                raise HarnessError(
                    f"{path}:{lineno}: image id {image_id} again, with {value} {rest!r} "
                    f"(line {first[image_id]} gives {table[image_id]!r})"
                )
            table.setdefault(image_id, rest)
            first.setdefault(image_id, lineno)
    return table


def _split_by_class(root: Path, paths: list[str], labels: np.ndarray, last_train_class: int):
    train = labels <= last_train_class
    idx_train, idx_test = np.flatnonzero(train), np.flatnonzero(~train)
    make = lambda idx: FileImageSet(root, [paths[i] for i in idx], labels[idx])  # noqa: E731
    return make(idx_train), make(idx_test)


@register_dataset(
    "cub200",
    description="CUB-200-2011 birds; classes 1-100 train (5,864), 101-200 test (5,924)",
    folder="CUB_200_2011",
    marker="images.txt",
    official=OfficialCounts(5_864, 100, 5_924, 100, source="Wah et al. 2011; DIML Sec. 4.1"),
)
def load_cub200(root: Path) -> DatasetSplits:
    images = _id_table(root / "images.txt", "path")
    label_file = root / "image_class_labels.txt"
    label_rows = _id_table(label_file, "class id")
    labels_by_id = dict(
        zip(label_rows, _labels(list(label_rows.values()), label_file).tolist(), strict=True)
    )
    ids = sorted(images, key=int)
    missing = [i for i in ids if i not in labels_by_id]
    if missing:
        raise HarnessError(
            f"image id {missing[0]} of images.txt has no row in {root / 'image_class_labels.txt'}"
        )
    paths = [f"images/{images[i]}" for i in ids]
    labels = np.array([labels_by_id[i] for i in ids], dtype=np.int64)
    train, test = _split_by_class(root, paths, labels, last_train_class=100)
    return DatasetSplits("cub200", train=train, test=test)


@register_dataset(
    "cars196",
    description="Stanford Cars196; classes 1-98 train (8,054), 99-196 test (8,131)",
    folder="cars196",
    marker="cars_annos.mat",
    official=OfficialCounts(8_054, 98, 8_131, 98, source="Krause et al. 2013; DIML Sec. 4.1"),
)
def load_cars196(root: Path) -> DatasetSplits:

    try:
        annos = loadmat(root / "cars_annos.mat", squeeze_me=True)["annotations"]
    except Exception as err:
        raise HarnessError(f"cannot read {root / 'cars_annos.mat'}: {err}") from None
    for needed in ("relative_im_path", "class"):
        if needed not in annos.dtype.names:
            raise HarnessError(f"{root / 'cars_annos.mat'} lacks the field '{needed}'")
    annos = np.atleast_1d(annos)
    paths = [str(a) for a in annos["relative_im_path"]]
    labels = np.array([int(c) for c in annos["class"]], dtype=np.int64)
    train, test = _split_by_class(root, paths, labels, last_train_class=98)
    return DatasetSplits("cars196", train=train, test=test)


def _read_ebay(path: Path) -> tuple[list[str], np.ndarray]:
    with open(_index_file(path), encoding="utf-8") as fh:
        header = fh.readline().split()
    if header[:4] != ["image_id", "class_id", "super_class_id", "path"]:
        raise HarnessError(
            f"{path}: expected header 'image_id class_id super_class_id path', got {' '.join(header)!r}"
        )
    class_ids, paths = _read_columns(path, (1, 3), skip=1, min_fields=4)
    return paths, _labels(class_ids, path)


@register_dataset(
    "sop",
    description="Stanford Online Products; 59,551 train / 11,318 classes, 60,502 test / 11,316 classes",
    folder="Stanford_Online_Products",
    marker="Ebay_train.txt",
    official=OfficialCounts(
        59_551, 11_318, 60_502, 11_316, source="Oh Song et al. 2016; DIML Sec. 4.1"
    ),
)
def load_sop(root: Path) -> DatasetSplits:
    train_paths, train_labels = _read_ebay(root / "Ebay_train.txt")
    test_paths, test_labels = _read_ebay(root / "Ebay_test.txt")
    return DatasetSplits(
        "sop",
        train=FileImageSet(root, train_paths, train_labels),
        test=FileImageSet(root, test_paths, test_labels),
    )


@register_dataset(
    "inshop",
    description="In-Shop Clothes Retrieval; 25,882 train, 14,218 query vs 12,612 gallery",
    folder="inshop",
    marker="list_eval_partition.txt",
    official=OfficialCounts(
        25_882, 3_997, 14_218, 3_985, gallery_images=12_612, source="Liu et al. 2016; DIABLO Sec. 5"
    ),
)
def load_inshop(root: Path) -> DatasetSplits:
    listing = root / "list_eval_partition.txt"
    lines = listing.read_text(encoding="utf-8").splitlines()
    if len(lines) < 2 or lines[1].split()[:3] != ["image_name", "item_id", "evaluation_status"]:
        raise HarnessError(
            f"{listing}: expected a count on line 1 and the header "
            "'image_name item_id evaluation_status' on line 2"
        )
    # Images live under Img/ in the official release (image_name starts with img/).
    image_root = root / "Img" if (root / "Img").is_dir() else root
    by_status: dict[str, tuple[list[str], list[str]]] = {
        "train": ([], []),
        "query": ([], []),
        "gallery": ([], []),
    }
    for lineno, line in enumerate(lines[2:], start=3):
        row = line.split()  # not kept: a list per row would set off the garbage collector
        if not row:
            continue
        if len(row) < 3 or row[2] not in by_status:
            raise HarnessError(f"malformed line {lineno} in {listing}: {' '.join(row)!r}")
        paths, labels = by_status[row[2]]
        paths.append(row[0])
        labels.append(row[1].removeprefix("id_"))

    def make(status: str) -> FileImageSet:
        return FileImageSet(
            image_root, by_status[status][0], _labels(by_status[status][1], listing)
        )

    return DatasetSplits("inshop", train=make("train"), test=make("query"), gallery=make("gallery"))
