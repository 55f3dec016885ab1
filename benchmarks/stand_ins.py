"""Stand-in trees of the four standard benchmarks at their real counts, for measuring only.

Each tree has the dataset's official layout and index files (what the loaders of
``harness.components.data.benchmarks`` read) and exactly the release's classes and images
per split, scaled by a fraction: SOP 11,318 training classes / 59,551 images and 11,316
test classes / 60,502 images; CUB-200-2011 classes 1-100 (5,864 images) and 101-200
(5,924); Cars196 classes 1-98 (8,054) and 99-196 (8,131); In-Shop 3,997 training items /
25,882 images and 3,985 test items with 14,218 queries and 12,612 gallery images.

The images are 64 px JPEGs: one encoded picture per class (a flat class colour with a
gradient), each file made distinct by a JPEG comment segment holding its own name, so
that writing 120,000 files costs little more than writing their bytes. Their content is
meaningless: no number measured on them is a result.

A tree is written once under its cache folder and reused when its ``complete.json``
(written last) names the same counts.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image
from scipy.io import savemat

#: Side of the stand-in JPEGs, in pixels, and their quality.
SIDE, QUALITY = 64, 75
#: Processes that write the files (the measuring machine has few cores).
WRITERS = 2
#: SOP's twelve super-classes, the folders of its images.
SOP_SUPER = (
    "bicycle cabinet chair coffee_maker fan kettle lamp mug sofa stapler table toaster".split()
)
COMPLETE = "complete.json"


@dataclass(frozen=True)
class Split:
    """One split of a stand-in: its classes and images (``gallery``: In-Shop's gallery
    images, which share the test split's items)."""

    classes: int
    images: int
    gallery: int = 0


#: The official counts (train, test) of each dataset.
OFFICIAL = {
    "sop": (Split(11_318, 59_551), Split(11_316, 60_502)),
    "cub200": (Split(100, 5_864), Split(100, 5_924)),
    "cars196": (Split(98, 8_054), Split(98, 8_131)),
    "inshop": (Split(3_997, 25_882), Split(3_985, 14_218, 12_612)),
}


def scaled_counts(dataset: str, fraction: float) -> tuple[Split, Split]:
    """The official counts times ``fraction``, rounded; at least 4 training classes (the
    smoke protocol carves two validation classes and keeps two) and 2 test classes, and at
    least 2 images a class (1 query and 1 gallery image an item for In-Shop)."""
    train, test = OFFICIAL[dataset]
    t_classes = max(4, round(train.classes * fraction))
    e_classes = max(2, round(test.classes * fraction))
    t = Split(t_classes, max(2 * t_classes, round(train.images * fraction)))
    if dataset == "inshop":
        return t, Split(
            e_classes,
            max(e_classes, round(test.images * fraction)),
            max(e_classes, round(test.gallery * fraction)),
        )
    return t, Split(e_classes, max(2 * e_classes, round(test.images * fraction)))


def class_sizes(classes: int, images: int, seed: int) -> np.ndarray:
    """``classes`` sizes summing to ``images``, as even as the totals allow, in a seeded
    order (the real sets' sizes vary; the total is what the stages scale with)."""
    sizes = np.full(classes, images // classes, dtype=np.int64)
    extra = np.random.default_rng(seed).choice(classes, images % classes, replace=False)
    sizes[extra] += 1
    return sizes


# ------------------------------------------------------------------------ images


def template(label: int) -> bytes:
    """The class's picture: a flat colour with a horizontal gradient, encoded once."""
    rng = np.random.default_rng(label)
    colour = rng.integers(0, 256, 3).astype(np.float32)
    ramp = np.linspace(0.6, 1.0, SIDE, dtype=np.float32)[None, :, None]
    pixels = np.broadcast_to(colour * ramp, (SIDE, SIDE, 3)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def with_comment(jpeg: bytes, text: str) -> bytes:
    """``jpeg`` with a comment segment (COM, ``FF FE``) right after its start marker."""
    payload = text.encode()
    return jpeg[:2] + b"\xff\xfe" + (len(payload) + 2).to_bytes(2, "big") + payload + jpeg[2:]


def write_class(job: tuple[str, int, list[str]]) -> int:
    """Write the files ``paths`` (under the folder ``root``) of class ``label``."""
    root, label, paths = job
    picture = template(label)
    for rel in paths:
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(with_comment(picture, rel))
    return len(paths)


def write_images(root: Path, by_class: dict[int, list[str]]) -> int:
    jobs = [(str(root), label, paths) for label, paths in by_class.items()]
    with Pool(WRITERS) as pool:
        return sum(pool.imap_unordered(write_class, jobs, chunksize=64))


# ------------------------------------------------------------------------ layouts


def numbered(train: Split, test: Split, seed: int) -> Iterator[tuple[str, int, int]]:
    """``(split, class id, image index in the class)`` for every image, class ids from 1,
    the test classes after the training ones."""
    label = 0
    for name, split in (("train", train), ("test", test)):
        for size in class_sizes(split.classes, split.images, seed + len(name)):
            label += 1
            for i in range(int(size)):
                yield name, label, i


def write_sop(base: Path, train: Split, test: Split) -> dict[int, list[str]]:
    """``Ebay_train.txt`` / ``Ebay_test.txt`` (``image_id class_id super_class_id path``)."""
    lines: dict[str, list[str]] = {"train": [], "test": []}
    by_class: dict[int, list[str]] = {}
    for image_id, (split, label, i) in enumerate(numbered(train, test, 0), start=1):
        sup = label % len(SOP_SUPER)
        rel = f"{SOP_SUPER[sup]}_final/{label}_{i}.JPG"
        lines[split].append(f"{image_id} {label} {sup + 1} {rel}")
        by_class.setdefault(label, []).append(rel)
    for split, rows in lines.items():
        text = "\n".join(["image_id class_id super_class_id path", *rows]) + "\n"
        (base / f"Ebay_{split}.txt").write_text(text)
    return by_class


def write_cub(base: Path, train: Split, test: Split) -> dict[int, list[str]]:
    """``images.txt`` and ``image_class_labels.txt``; training classes are ids 1-100 and
    test classes 101-200 (the loader splits at 100), however many a fraction keeps."""
    images, labels, by_class = [], [], {}
    for image_id, (split, label, i) in enumerate(numbered(train, test, 0), start=1):
        cls = label if split == "train" else 100 + label - train.classes
        rel = f"{cls:03d}.Bird_{cls}/Bird_{cls}_{i:04d}.jpg"
        images.append(f"{image_id} {rel}")
        labels.append(f"{image_id} {cls}")
        by_class.setdefault(cls, []).append(f"images/{rel}")
    (base / "images.txt").write_text("\n".join(images) + "\n")
    (base / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    return by_class


def write_cars(base: Path, train: Split, test: Split) -> dict[int, list[str]]:
    """``cars_annos.mat`` with the devkit's struct fields; training classes 1-98, test
    classes from 99 (the loader splits at 98)."""
    fields = ["relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test"]
    rows, by_class = [], {}
    for n, (split, label, i) in enumerate(numbered(train, test, 0), start=1):
        cls = label if split == "train" else 98 + label - train.classes
        rel = f"car_ims/{n:06d}.jpg"
        rows.append((rel, 1, 1, SIDE, SIDE, cls, i % 2))
        by_class.setdefault(cls, []).append(rel)
    annotations = np.array(rows, dtype=[(f, "O") for f in fields])
    savemat(base / "cars_annos.mat", {"annotations": annotations.reshape(1, -1)})
    return by_class


def write_inshop(base: Path, train: Split, test: Split) -> dict[int, list[str]]:
    """``list_eval_partition.txt`` (a count, the header, rows train / query / gallery);
    images under ``Img/``. Each test item has at least one query and one gallery image."""
    rows, by_class = [], {}
    queries = class_sizes(test.classes, test.images, 1)
    gallery = class_sizes(test.classes, test.gallery, 2)
    items = [("train", int(s)) for s in class_sizes(train.classes, train.images, 0)]
    for q, g in zip(queries, gallery, strict=True):
        items += [("query", int(q)), ("gallery", int(g))]
    item = 0
    for status, count in items:
        item += status != "gallery"  # a gallery's images belong to the query's item
        for i in range(count):
            rel = f"img/WOMEN/Dresses/id_{item:08d}/{i:02d}_{status}.jpg"
            rows.append(f"{rel} id_{item:08d} {status}")
            by_class.setdefault(item, []).append(f"Img/{rel}")
    header = f"{len(rows)}\nimage_name item_id evaluation_status\n"
    (base / "list_eval_partition.txt").write_text(header + "\n".join(rows) + "\n")
    return by_class


#: Each dataset's folder under the data root and the writer of its index files.
LAYOUTS = {
    "sop": ("Stanford_Online_Products", write_sop),
    "cub200": ("CUB_200_2011", write_cub),
    "cars196": ("cars196", write_cars),
    "inshop": ("inshop", write_inshop),
}


def stand_in(dataset: str, fraction: float, cache: Path) -> tuple[Path, dict, bool]:
    """The data root holding the stand-in of ``dataset`` at ``fraction`` (written unless
    a complete one with the same counts is there), its counts, and whether it was written."""
    root = cache / f"{dataset}-{fraction:g}"
    train, test = scaled_counts(dataset, fraction)
    counts = {
        "dataset": dataset,
        "fraction": fraction,
        "train": asdict(train),
        "test": asdict(test),
    }
    done = root / COMPLETE
    if done.is_file() and json.loads(done.read_text()) == counts:
        return root, counts, False
    shutil.rmtree(root, ignore_errors=True)
    folder, write_index = LAYOUTS[dataset]
    base = root / folder
    base.mkdir(parents=True)
    by_class = write_index(base, train, test)
    write_images(base, by_class)
    done.write_text(json.dumps(counts))
    return root, counts, True
