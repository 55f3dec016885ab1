"""Image sets, split containers and the dataset registry.

A dataset loader returns :class:`DatasetSplits` with class-disjoint ``train`` and
``test`` sets (or ``query``/``gallery`` for In-Shop). The harness, not the
loader, carves the validation classes out of ``train`` (:func:`carve_validation`),
so every dataset gets the same seeded, class-disjoint rule.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from harness.base.errors import HarnessError
from harness.base.registry import Registry
from harness.components.data.manifest import FileManifest

__all__ = [
    "ImageSet",
    "FileImageSet",
    "ArrayImageSet",
    "DatasetSplits",
    "DatasetInfo",
    "OfficialCounts",
    "check_class_disjoint",
    "check_official_counts",
    "indices_by_class",
    "DATASETS",
    "register_dataset",
    "default_data_root",
    "DATA_ROOT_SETTING",
    "data_root_folder",
    "carve_validation",
    "cap_per_class",
    "VALIDATION_SPLIT_TAG",
    "GIVEN_VALIDATION",
]


#: The run tag (and its value) saying that the validation split came with the dataset
#: (:attr:`DatasetSplits.val_given`), so that a table does not call it the protocol's carve.
VALIDATION_SPLIT_TAG, GIVEN_VALIDATION = "validation_split", "dataset"


def default_data_root() -> Path:
    """``$DML_HARNESS_DATA`` or ``~/.cache/dml-harness``."""
    return Path(os.environ.get("DML_HARNESS_DATA", "~/.cache/dml-harness")).expanduser()


#: How an error line names the default data root.
DATA_ROOT_SETTING = "the data root ($DML_HARNESS_DATA, else ~/.cache/dml-harness)"


def data_root_folder(data_root: Path | None) -> Path:
    """``data_root`` (``--data-root``), else :func:`default_data_root`; one that exists but
    is not a folder (a file) is one error line naming where it came from. A root not there
    yet is returned as it is (datasets are then missing, or generated there)."""
    root = Path(data_root) if data_root is not None else default_data_root()
    if root.exists() and not root.is_dir():
        flag = "--data-root" if data_root is not None else DATA_ROOT_SETTING
        raise HarnessError(f"{flag} {root} is a file, not a folder")
    return root


class ImageSet:
    """Labelled images: ``len``, ``labels`` (int64, N) and ``read(i) -> PIL RGB image``."""

    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, index: int) -> Image.Image:
        raise NotImplementedError

    def keys(self) -> Sequence[str]:
        """Stable identifiers of the images (for the split digest)."""
        raise NotImplementedError

    def subset(self, indices: np.ndarray) -> ImageSet:
        raise NotImplementedError

    @property
    def num_classes(self) -> int:
        return int(np.unique(self.labels).size)


class FileImageSet(ImageSet):
    def __init__(self, root: Path, relpaths: Sequence[str], labels: Sequence[int] | np.ndarray):
        self.root = Path(root)
        self.relpaths = list(relpaths)
        self.labels = np.asarray(labels, dtype=np.int64)
        if len(self.relpaths) != len(self.labels):
            raise ValueError("paths and labels differ in length")

    def read(self, index: int) -> Image.Image:
        path = self.root / self.relpaths[index]
        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except FileNotFoundError:
            raise HarnessError(f"image listed by the dataset is missing: {path}") from None
        except Exception as err:  # PIL raises several types for broken files
            raise HarnessError(f"corrupt image {path}: {type(err).__name__}: {err}") from None

    def keys(self) -> Sequence[str]:
        return self.relpaths

    def subset(self, indices: np.ndarray) -> FileImageSet:
        return FileImageSet(self.root, [self.relpaths[i] for i in indices], self.labels[indices])


class ArrayImageSet(ImageSet):
    """Images held in memory as uint8 arrays (N x H x W or N x H x W x 3)."""

    def __init__(
        self,
        images: np.ndarray,
        labels: Sequence[int] | np.ndarray,
        ids: Sequence[str] | None = None,
    ):
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.ids = list(ids) if ids is not None else [str(i) for i in range(len(self.labels))]

    def read(self, index: int) -> Image.Image:
        return Image.fromarray(self.images[index]).convert("RGB")

    def keys(self) -> Sequence[str]:
        return self.ids

    def subset(self, indices: np.ndarray) -> ArrayImageSet:
        return ArrayImageSet(
            self.images[indices], self.labels[indices], [self.ids[i] for i in indices]
        )


@dataclass
class DatasetSplits:
    """Class-disjoint splits of one dataset.

    ``test`` is searched against itself; when ``gallery`` is set (In-Shop),
    ``test`` holds the queries and is searched against ``gallery``.
    """

    name: str
    train: ImageSet
    test: ImageSet
    val: ImageSet | None = None
    gallery: ImageSet | None = None
    #: Extra per-image data some datasets carry (e.g. synthetic part masks).
    extras: dict = field(default_factory=dict)
    #: A dataset given by its path: its file list, whose fingerprint covers file sizes too.
    files: FileManifest | None = None
    #: Whether ``val`` came with the dataset (a CSV's validation rows), not carved from the
    #: training classes by the protocol: tables say which.
    val_given: bool = False

    def digest(self) -> str:
        """Hash of every image key and label in every split (part of the fingerprint), and
        of the file list's fingerprint for a dataset given by its path (so that a file
        replaced by another of the same name changes it)."""
        h = hashlib.sha256(self.name.encode())
        for split_name in ("train", "val", "test", "gallery"):
            split = getattr(self, split_name)
            if split is None:
                continue
            h.update(split_name.encode())
            sealed = getattr(split, "digest", None)
            if isinstance(sealed, str):  # a sealed split (folds.SealedImageSet): its hidden content
                h.update(sealed.encode())
                continue
            for key, label in zip(split.keys(), split.labels.tolist(), strict=True):
                h.update(f"{key}\t{label}\n".encode())
        if self.files is not None:
            h.update(f"files\t{self.files.fingerprint}\n".encode())
        return h.hexdigest()[:16]


@dataclass(frozen=True)
class OfficialCounts:
    """Images and classes of a benchmark's official release, per split (In-Shop: the
    test classes are those of query and gallery together)."""

    train_images: int
    train_classes: int
    test_images: int
    test_classes: int
    gallery_images: int = 0
    #: Where the numbers come from (paper section, dataset documentation).
    source: str = ""

    @property
    def images(self) -> int:
        return self.train_images + self.test_images + self.gallery_images


def _split_counts(splits: DatasetSplits) -> tuple[int, int, int, int, int]:
    test_labels = (
        splits.test.labels
        if splits.gallery is None
        else np.concatenate([splits.test.labels, splits.gallery.labels])
    )
    return (
        len(splits.train),
        splits.train.num_classes,
        len(splits.test),
        int(np.unique(test_labels).size),
        0 if splits.gallery is None else len(splits.gallery),
    )


def check_class_disjoint(splits: DatasetSplits) -> None:
    """Zero-shot retrieval trains and tests on disjoint classes: a class in both is an error."""
    test = [s.labels for s in (splits.test, splits.gallery) if s is not None]
    shared = np.intersect1d(splits.train.labels, np.concatenate(test))
    if shared.size:
        raise HarnessError(
            f"dataset '{splits.name}': {shared.size} class(es) are in both the training and the "
            f"test split (e.g. class {shared[0]}); zero-shot retrieval needs class-disjoint splits"
        )


def check_official_counts(splits: DatasetSplits, official: OfficialCounts) -> None:
    """On a tree that lists at least as many images as the official release (the full
    release, or one claiming to be), every split's image and class count must be the
    official one: a tree from another release or a damaged index file would otherwise
    give numbers that look comparable and are not. A tree with fewer images is partial
    (a subset, or the small fixture trees of the tests): one line on stderr says the
    counts were not checked, since a partial tree cannot be told from a broken one."""
    got = _split_counts(splits)
    listed = got[0] + got[2] + got[4]
    if listed < official.images:
        print(
            f"dataset '{splits.name}': {listed:,} of the official release's {official.images:,} images "
            f"listed (a partial tree); official split counts not checked",
            file=sys.stderr,
        )
        return
    want = (
        official.train_images,
        official.train_classes,
        official.test_images,
        official.test_classes,
        official.gallery_images,
    )
    if got != want:
        names = ("train images", "train classes", "test images", "test classes", "gallery images")
        wrong = ", ".join(
            f"{n} {g:,} (official {w:,})"
            for n, g, w in zip(names, got, want, strict=True)
            if g != w
        )
        raise HarnessError(
            f"dataset '{splits.name}' lists {listed:,} images, a full release, but not the "
            f"official splits: {wrong} [{official.source}]"
        )


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    description: str
    #: Sub-folder of the data root where the dataset is looked for.
    folder: str
    #: The file whose presence marks a valid root (relative to it).
    marker: str
    loader: Callable[..., DatasetSplits]  # (Path) -> splits; (Path | None) when embedded
    #: Whether the harness can produce the data itself (no root needed).
    embedded: bool = False
    #: The official release's split counts, checked on a full tree (benchmarks only).
    official: OfficialCounts | None = None
    #: The training classes under a data root, told without loading or generating the
    #: images (a set the harness generates, before it is there); None: loading tells.
    train_classes: Callable[[Path | None], int] | None = None
    #: The dataset gives its own validation split (a CSV's ``validation`` rows).
    val_given: bool = False

    def argument(self) -> str:
        """How a command line names the dataset (``datasets verify NAME``)."""
        return self.name

    def candidates(self, data_root: Path | None) -> list[Path]:
        root = Path(data_root) if data_root else default_data_root()
        return [root, root / self.folder]

    def locate(self, data_root: Path | None) -> Path:
        """The folder holding ``marker``; else a one-line error naming where it looked."""
        for candidate in self.candidates(data_root):
            if (candidate / self.marker).exists():
                return candidate
        looked = " or ".join(str(c / self.marker) for c in self.candidates(data_root))
        raise HarnessError(
            f"dataset '{self.name}' not found: expected {looked} (pass --data-root DIR)"
        )

    def load(self, data_root: Path | None) -> DatasetSplits:
        """The loader's splits, checked: class-disjoint, and official counts on a full tree."""
        splits = self.loader(data_root) if self.embedded else self.loader(self.locate(data_root))
        check_class_disjoint(splits)
        if self.official is not None:
            check_official_counts(splits, self.official)
        return splits


DATASETS: Registry[DatasetInfo] = Registry("dataset")


def register_dataset(
    name: str,
    *,
    description: str,
    folder: str,
    marker: str,
    embedded: bool = False,
    official: OfficialCounts | None = None,
    train_classes: Callable[[Path | None], int] | None = None,
):
    def add(loader):
        DATASETS.register(name)(
            DatasetInfo(
                name, description, folder, marker, loader, embedded, official, train_classes
            )
        )
        return loader

    return add


def carve_validation(splits: DatasetSplits, fraction: float, seed: int) -> DatasetSplits:
    """Move a seeded, class-disjoint ``fraction`` of the training classes into ``val``.

    At least two classes go to validation (a single class makes every retrieval
    metric trivially perfect) and at least two stay for training.
    """
    if fraction <= 0:
        return splits
    classes = np.unique(splits.train.labels)
    n_val = max(2, int(round(fraction * classes.size)))
    if n_val < 2 or classes.size - n_val < 2:
        raise HarnessError(
            f"splits.validation_classes={fraction} leaves too few classes "
            f"({classes.size} training classes in '{splits.name}')"
        )
    rng = np.random.default_rng(seed)
    val_classes = rng.choice(classes, size=n_val, replace=False)
    in_val = np.isin(splits.train.labels, val_classes)
    splits.val = splits.train.subset(np.flatnonzero(in_val))
    splits.train = splits.train.subset(np.flatnonzero(~in_val))
    return splits


def seen_class_control(splits: DatasetSplits, pool: ImageSet, cap: int, seed: int) -> DatasetSplits:
    """Train on other images of the test classes: a diagnostic, never a benchmark split.

    Zero-shot retrieval trains and tests on disjoint classes, so a run that does not beat
    its initial model leaves two explanations: the training is broken, or what it learns
    does not transfer to the test classes. Training on ``pool`` images of the test classes
    that are not test images (at most ``cap`` per class, seeded) tells them apart. The
    validation and test sets stay the protocol's own, so model selection is unchanged.
    """
    if splits.gallery is not None:
        raise HarnessError(
            f"the seen-class control needs a test set searched against itself; "
            f"'{splits.name}' searches queries against a gallery"
        )
    spare = np.flatnonzero(
        ~np.isin(np.asarray(pool.keys()), np.asarray(splits.test.keys()))
        & np.isin(pool.labels, splits.test.labels)
    )
    if spare.size == 0:
        raise HarnessError(
            f"the seen-class control needs test-class images the protocol does not test on; "
            f"'{splits.name}' tests on all of them (set splits.max_test_images_per_class)"
        )
    splits.train = cap_per_class(pool.subset(spare), cap, seed)
    return splits


def shuffled_label_control(splits: DatasetSplits, seed: int) -> DatasetSplits:
    """Train on the training images with their labels permuted (seeded): a diagnostic,
    never a benchmark split. The data randomisation test of Adebayo et al. ("Sanity Checks
    for Saliency Maps", NeurIPS 2018, Sec. 3.2): a model trained on random labels has
    learned no class, so an explanation that reads the same on it as on the trained model
    does not explain what training taught. The validation and test sets stay the
    protocol's own."""
    rng = np.random.default_rng(seed)
    train = splits.train.subset(np.arange(len(splits.train)))
    train.labels = rng.permutation(train.labels)
    splits.train = train
    return splits


def cap_per_class(images: ImageSet, cap: int, seed: int) -> ImageSet:
    """Keep at most ``cap`` images per class (seeded, order preserved); 0 keeps all."""
    if cap <= 0:
        return images
    rng = np.random.default_rng(seed)
    keep = []
    for idx in indices_by_class(images.labels):
        if idx.size > cap:
            idx = np.sort(rng.choice(idx, size=cap, replace=False))
        keep.append(idx)
    return images.subset(np.sort(np.concatenate(keep)))


def indices_by_class(labels: np.ndarray) -> list[np.ndarray]:
    """Each class's image indices, ascending, the classes in ``np.unique``'s order: one
    stable sort, where a scan of the labels per class would cost images x classes (SOP:
    120,053 x 22,634)."""
    _, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    order = np.argsort(codes.reshape(-1), kind="stable")
    return np.split(order, np.cumsum(counts)[:-1])
