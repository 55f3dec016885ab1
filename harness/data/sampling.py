"""Batch sampling: ``classes_per_batch`` classes x ``samples_per_class`` images, seeded per epoch."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from ..errors import HarnessError

__all__ = ["ClassBalancedBatchSampler", "TransformedImages"]


class ClassBalancedBatchSampler(Sampler[list[int]]):
    """Each batch draws ``classes_per_batch`` distinct classes, then ``samples_per_class``
    images of each (without replacement when the class has enough, as in the seeds'
    ``class_random_sampler``). The order depends only on ``(seed, epoch)``, so a run
    resumed at an epoch boundary sees exactly the batches of an uninterrupted one.
    """

    def __init__(self, labels: np.ndarray, *, classes_per_batch: int, samples_per_class: int,
                 batches_per_epoch: int = 0, seed: int = 0):
        self.labels = np.asarray(labels)
        self.classes = np.unique(self.labels)
        if self.classes.size < classes_per_batch:
            raise HarnessError(
                f"sampling.classes_per_batch={classes_per_batch} but the training split has only "
                f"{self.classes.size} classes"
            )
        self.by_class = {c: np.flatnonzero(self.labels == c) for c in self.classes}
        self.classes_per_batch = classes_per_batch
        self.samples_per_class = samples_per_class
        batch = classes_per_batch * samples_per_class
        self.num_batches = batches_per_epoch or max(1, len(self.labels) // batch)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        for _ in range(self.num_batches):
            batch = []
            for c in rng.choice(self.classes, size=self.classes_per_batch, replace=False):
                pool = self.by_class[c]
                replace = pool.size < self.samples_per_class
                batch.extend(rng.choice(pool, size=self.samples_per_class, replace=replace).tolist())
            yield batch


class TransformedImages(Dataset):
    """``(image tensor, label, index)`` from an :class:`ImageSet` and a transform."""

    def __init__(self, images, transform, label_map: dict[int, int] | None = None):
        self.images = images
        self.transform = transform
        self.label_map = label_map

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        label = int(self.images.labels[index])
        if self.label_map is not None:
            label = self.label_map[label]
        return self.transform(self.images.read(index)), torch.tensor(label), index
