"""Fashion-MNIST as a zero-shot retrieval task: classes 0-4 train, 5-9 test.

Reads the four idx files (gzipped or not) from ``--data-root``, else from the
Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``).
The official train and test files are pooled before the class-disjoint split.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from harness.base.errors import HarnessError
from harness.components.data.base import (
    ArrayImageSet,
    DatasetSplits,
    default_data_root,
    register_dataset,
)

DEBIAN_PATH = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path) -> np.ndarray:
    """Read an idx file (magic: two zero bytes, dtype 0x08 for uint8, number of dims)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise HarnessError(f"{path} is not a uint8 idx file")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise HarnessError(
            f"{path} is truncated: expected {int(np.prod(shape))} values, found {body.size}"
        )
    return body.reshape(shape)


def _find(root: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    return None


def fashion_mnist_root(data_root: Path | None) -> Path:
    bases = [Path(data_root), Path(data_root) / "fashion-mnist"] if data_root else []
    bases += [default_data_root() / "fashion-mnist", DEBIAN_PATH]
    for base in bases:
        if _find(base, FILES["train"][0]):
            return base
    looked = " or ".join(str(b / (FILES["train"][0] + ".gz")) for b in bases)
    raise HarnessError(
        f"dataset 'fashion-mnist' not found: expected {looked} "
        "(apt-get install dataset-fashion-mnist, or pass --data-root DIR)"
    )


@register_dataset(
    "fashion-mnist",
    description="Fashion-MNIST, zero-shot: classes 0-4 train (35,000), 5-9 test (35,000)",
    folder="fashion-mnist",
    marker="train-images-idx3-ubyte.gz",
    embedded=True,  # resolves its own root (Debian path fallback)
)
def load_fashion_mnist(data_root: Path | None) -> DatasetSplits:
    root = fashion_mnist_root(data_root)
    images, labels, ids = [], [], []
    for part, (img_stem, lbl_stem) in FILES.items():
        img_path, lbl_path = _find(root, img_stem), _find(root, lbl_stem)
        if img_path is None or lbl_path is None:
            raise HarnessError(
                f"dataset 'fashion-mnist' incomplete: expected {root / (img_stem + '.gz')} "
                f"and {root / (lbl_stem + '.gz')}"
            )
        x, y = read_idx(img_path), read_idx(lbl_path)
        if len(x) != len(y):
            raise HarnessError(f"{img_path} and {lbl_path} hold different numbers of items")
        images.append(x)
        labels.append(y.astype(np.int64))
        ids += [f"{part}/{i}" for i in range(len(y))]
    x, y = np.concatenate(images), np.concatenate(labels)
    train = y <= 4
    ids_arr = np.array(ids)
    return DatasetSplits(
        "fashion-mnist",
        train=ArrayImageSet(x[train], y[train], ids_arr[train].tolist()),
        test=ArrayImageSet(x[~train], y[~train], ids_arr[~train].tolist()),
    )
