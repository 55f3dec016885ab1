"""Class-disjoint cross-validation folds over the training classes, and the test split
sealed while hyperparameters are searched.

Musgrave et al., "A Metric Learning Reality Check" (ECCV 2020), Sec. 4.2 ("Hyperparameter
search"): the training half of the classes is split class-disjointly into k = 4 folds;
each trial trains k models, model i on the other k - 1 folds with early stopping and
scoring on fold i, and the trial's score is the mean over the k validation scores. The
test classes are never seen while searching. :func:`class_folds` draws that partition
from a seed alone (the same on every worker and after a restart); :func:`fold_splits`
returns fold i's training and validation sets; :func:`seal_test` replaces the test split
by one that refuses to be read, so a search run that opened it would fail, not leak.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
from PIL import Image

from harness.base.errors import HarnessError
from harness.components.data.base import DatasetSplits, ImageSet

__all__ = [
    "class_folds",
    "check_fold_count",
    "check_fold_splits",
    "fold_splits",
    "SealedImageSet",
    "SealedSplitRead",
    "seal_test",
]


class SealedSplitRead(HarnessError):
    """The test split was read while it is sealed (the search phase of a tuned grid)."""


def check_fold_count(folds: int, classes: int | None, *, own_validation: bool = False) -> None:
    """What ``folds`` class-disjoint folds need of a training split of ``classes`` classes
    (None: not known yet): two classes per fold, and (``own_validation``: the dataset gives
    its own validation split) no more than one fold, as k > 1 folds would replace that
    split; one line (``folds = ...``) for either."""
    if folds < 1:
        raise HarnessError(f"folds = {folds}: expected at least 1")
    if own_validation and folds > 1:
        raise HarnessError(
            f"folds = {folds} draws validation folds from the training classes, but the dataset "
            f"gives its own validation split; use folds = 1 (that split) or a dataset without one"
        )
    if classes is not None and classes < 2 * folds:
        raise HarnessError(
            f"folds = {folds} needs at least {2 * folds} training classes (2 per fold); "
            f"the training split has {classes}"
        )


def class_folds(labels: np.ndarray, folds: int, seed: int) -> list[np.ndarray]:
    """The training classes in ``folds`` class-disjoint groups of near-equal size
    (sorted class ids each): a seeded permutation of the sorted classes, dealt out in
    order. Every class is in exactly one fold; at least two classes per fold (a single
    class makes every retrieval metric trivially perfect)."""
    classes = np.unique(np.asarray(labels))
    check_fold_count(folds, classes.size)
    order = np.random.default_rng(np.random.SeedSequence([seed, folds])).permutation(classes)
    return [np.sort(part) for part in np.array_split(order, folds)]


def check_fold_splits(splits: DatasetSplits, folds: int) -> None:
    """What ``folds`` class-disjoint folds need of ``splits`` (the whole training split):
    :func:`check_fold_count` of its classes and its validation split."""
    check_fold_count(
        folds, int(np.unique(splits.train.labels).size), own_validation=splits.val is not None
    )


def fold_splits(splits: DatasetSplits, folds: int, fold: int, seed: int) -> DatasetSplits:
    """Fold ``fold`` of ``folds`` over ``splits.train`` (the whole training split, no
    validation carved): validation = the fold's classes, training = the other folds'.
    ``folds = 1`` is not a cross-validation and is the caller's (the protocol's own
    validation carve)."""
    if splits.val is not None:
        raise HarnessError(
            "cross-validation folds are drawn from the whole training split; this one already "
            "has a validation split"
        )
    if folds < 2 or not 0 <= fold < folds:
        raise HarnessError(f"fold {fold} of {folds}: expected folds >= 2 and 0 <= fold < folds")
    held_out = class_folds(splits.train.labels, folds, seed)[fold]
    in_val = np.isin(splits.train.labels, held_out)
    return DatasetSplits(
        name=splits.name,
        train=splits.train.subset(np.flatnonzero(~in_val)),
        test=splits.test,
        val=splits.train.subset(np.flatnonzero(in_val)),
        gallery=splits.gallery,
        extras=splits.extras,
        files=splits.files,
    )


class SealedImageSet(ImageSet):
    """A split that may not be read: its labels, keys and images raise
    :class:`SealedSplitRead` (its length, the published image count, is known). Its
    ``digest`` (of the keys and labels it hides) stands in for it in the run's
    fingerprint, so a search run's fingerprint still names its data."""

    def __init__(self, images: ImageSet, what: str):
        h = hashlib.sha256()
        for key, label in zip(images.keys(), images.labels.tolist(), strict=True):
            h.update(f"{key}\t{label}\n".encode())
        self.digest = h.hexdigest()
        self.what = what
        self.size = len(images)  # how many images: a count the protocol publishes, not content

    def _refuse(self):
        raise SealedSplitRead(
            f"the test split is sealed during {self.what}: hyperparameters are chosen on "
            f"validation folds of the training classes only"
        )

    @property
    def labels(self) -> np.ndarray:  # type: ignore[override]
        self._refuse()
        raise AssertionError  # unreachable

    def __len__(self) -> int:
        return self.size

    def read(self, index: int) -> Image.Image:
        self._refuse()
        raise AssertionError

    def keys(self) -> Sequence[str]:
        self._refuse()
        return ()

    def subset(self, indices: np.ndarray) -> ImageSet:
        self._refuse()
        return self


def seal_test(splits: DatasetSplits, what: str) -> DatasetSplits:
    """``splits`` with the test split (and gallery) sealed: any read raises."""
    return DatasetSplits(
        name=splits.name,
        train=splits.train,
        test=SealedImageSet(splits.test, what),
        val=splits.val,
        gallery=None if splits.gallery is None else SealedImageSet(splits.gallery, what),
        extras=splits.extras,
        files=splits.files,
        val_given=splits.val_given,
    )
