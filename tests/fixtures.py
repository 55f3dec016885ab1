"""Miniature dataset trees in the exact official file formats (the real sets cannot be
downloaded here). Each builder writes tiny JPEGs and the official index files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
from PIL import Image


def _jpeg(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(path, "JPEG")


def make_cub(root: Path, classes: int = 200, per_class: int = 2) -> Path:
    """CUB_200_2011/images/NNN.Name/*.jpg + images.txt + image_class_labels.txt."""
    base = root / "CUB_200_2011"
    images, labels = [], []
    image_id = 1
    for c in range(1, classes + 1):
        folder = f"{c:03d}.Bird_{c}"
        for i in range(per_class):
            rel = f"{folder}/Bird_{c}_{i:04d}.jpg"
            _jpeg(base / "images" / rel, image_id)
            images.append(f"{image_id} {rel}")
            labels.append(f"{image_id} {c}")
            image_id += 1
    (base / "images.txt").write_text("\n".join(images) + "\n")
    (base / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    return base


def make_cars(root: Path, classes: int = 196, per_class: int = 2) -> Path:
    """cars_annos.mat with the official struct fields + car_ims/*.jpg."""
    from scipy.io import savemat

    base = root / "cars196"
    dtype = [
        ("relative_im_path", "O"),
        ("bbox_x1", "O"),
        ("bbox_y1", "O"),
        ("bbox_x2", "O"),
        ("bbox_y2", "O"),
        ("class", "O"),
        ("test", "O"),
    ]
    rows = []
    n = 0
    for c in range(1, classes + 1):
        for i in range(per_class):
            n += 1
            rel = f"car_ims/{n:06d}.jpg"
            _jpeg(base / rel, n)
            # The official `test` flag mixes classes; DML ignores it.
            rows.append((rel, 1, 1, 20, 20, c, i % 2))
    annotations = np.array(rows, dtype=dtype)
    savemat(
        base / "cars_annos.mat",
        {
            "annotations": annotations.reshape(1, -1),
            "class_names": np.array([f"car {c}" for c in range(1, classes + 1)], dtype=object),
        },
    )
    return base


def make_sop(root: Path, train_classes: int = 6, test_classes: int = 5) -> Path:
    """Ebay_train.txt / Ebay_test.txt with header 'image_id class_id super_class_id path'."""
    base = root / "Stanford_Online_Products"
    header = "image_id class_id super_class_id path"
    image_id, class_id = 1, 1
    for split, n_classes in (("train", train_classes), ("test", test_classes)):
        lines = [header]
        for _ in range(n_classes):
            for i in range(2 + class_id % 3):  # unequal class sizes, as in SOP
                rel = f"bicycle_final/{class_id}_{i}.JPG"
                _jpeg(base / rel, image_id)
                lines.append(f"{image_id} {class_id} 1 {rel}")
                image_id += 1
            class_id += 1
        (base / f"Ebay_{split}.txt").write_text("\n".join(lines) + "\n")
    return base


def make_inshop(root: Path) -> Path:
    """list_eval_partition.txt: a count, the header, rows with train/query/gallery."""
    base = root / "inshop"
    rows = []
    spec = {
        "train": [(1, 3), (2, 2), (3, 2)],
        "query": [(4, 1), (5, 2), (6, 1)],
        "gallery": [(4, 2), (5, 1), (6, 2), (7, 1)],
    }
    n = 0
    for status, items in spec.items():
        for item, count in items:
            for i in range(count):
                n += 1
                rel = f"img/WOMEN/Dresses/id_{item:08d}/{i:02d}_{status}.jpg"
                _jpeg(base / "Img" / rel, n)
                rows.append(f"{rel} id_{item:08d} {status}")
    text = f"{len(rows)}\nimage_name item_id evaluation_status\n" + "\n".join(rows) + "\n"
    (base / "list_eval_partition.txt").write_text(text)
    return base


def _idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def make_fashion_mnist(root: Path, per_class: int = 3) -> Path:
    base = root / "fashion-mnist"
    base.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for stem, n in (("train", per_class * 10), ("t10k", per_class * 10)):
        labels = np.arange(n) % 10
        _idx(base / f"{stem}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)))
        _idx(base / f"{stem}-labels-idx1-ubyte.gz", labels)
    return base
