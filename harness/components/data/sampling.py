"""Batch sampling, seeded per epoch: ``classes_per_batch`` classes x ``samples_per_class``
images (:class:`ClassBalancedBatchSampler`, the protocol's ``sampling.sampler = "classes"``),
or batches of that size cut from a random permutation (:class:`ShuffledBatchSampler`,
``"shuffle"``); :func:`batch_sampler` builds the protocol's.

Each image of a training batch can carry its own augmentation seed (``sample_seeds``),
derived from ``(seed, epoch, batch, position in the global batch)``: its crop and flip
then depend neither on the number of loader workers, nor on whether they persist across
epochs, nor on how many processes share the batch, and a run resumed at an epoch
boundary draws exactly the augmentations of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from harness.base.errors import HarnessError
from harness.components.data.base import indices_by_class

__all__ = [
    "ClassBalancedBatchSampler",
    "ShuffledBatchSampler",
    "TransformedImages",
    "batch_sampler",
]


class ClassBalancedBatchSampler(Sampler[list[int]]):
    """Each batch draws ``classes_per_batch`` distinct classes, then ``samples_per_class``
    distinct images of each (with replacement only when the class has too few). The
    order depends only on ``(seed, epoch)``, so a run resumed at an epoch boundary sees
    exactly the batches of an uninterrupted one.

    The seeds' ``class_random_sampler`` draws otherwise, and each choice is an argument
    (the protocol's ``sampling`` keys): ``images_with_replacement`` draws each class's
    images with replacement, as DGML-master does (XinyiXuXD/DGML-master@7834411
    datasampler/class_random_sampler.py:43, ``np.random.choice`` with its default
    ``replace=True``) and wl-zhao/DIML does (@c15dbea, same file, l. 43: one
    ``random.choice`` per image); ``classes_with_replacement`` draws the batch's classes
    with replacement, as DIML does (l. 41-42: one ``random.choice`` of a class per slot;
    56 draws from 100 classes give about 43 distinct ones), where DGML draws distinct
    classes (l. 40).

    Across ``world_size`` processes (``torchrun``), every process draws the same global
    batch (same seed) and yields its share: the ``classes_per_batch / world_size``
    classes at positions ``rank * k ... (rank + 1) * k - 1``, so the shares gathered in
    rank order are the single-process batch. ``sample_seeds=True`` yields
    ``(index, augmentation seed)`` pairs instead of indices (:class:`TransformedImages`
    seeds the image's transform with it).
    """

    def __init__(
        self,
        labels: np.ndarray,
        *,
        classes_per_batch: int,
        samples_per_class: int,
        batches_per_epoch: int = 0,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        sample_seeds: bool = False,
        classes_with_replacement: bool = False,
        images_with_replacement: bool = False,
    ):
        self.labels = np.asarray(labels)
        self.classes = np.unique(self.labels)
        if self.classes.size < classes_per_batch and not classes_with_replacement:
            raise HarnessError(
                f"sampling.classes_per_batch={classes_per_batch} but the training split has only "
                f"{self.classes.size} classes"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise HarnessError(
                f"rank {rank} of world size {world_size}: need 0 <= rank < world_size"
            )
        if classes_per_batch % world_size:
            raise HarnessError(
                f"sampling.classes_per_batch={classes_per_batch} does not split across {world_size} "
                f"processes: each process takes the same number of classes of a global batch, so "
                f"classes_per_batch must be a multiple of the number of processes"
            )
        self.by_class = dict(zip(self.classes, indices_by_class(self.labels), strict=True))
        self.classes_per_batch = classes_per_batch
        self.samples_per_class = samples_per_class
        batch = classes_per_batch * samples_per_class
        self.num_batches = batches_per_epoch or max(1, len(self.labels) // batch)
        self.seed = seed
        self.epoch = 0
        self.rank, self.world_size, self.sample_seeds = rank, world_size, sample_seeds
        self.classes_with_replacement = classes_with_replacement
        self.images_with_replacement = images_with_replacement

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[Any]]:  # indices, or (index, seed) pairs
        rng = np.random.default_rng([self.seed, self.epoch])
        share = self.classes_per_batch // self.world_size * self.samples_per_class
        start = self.rank * share
        for number in range(self.num_batches):
            batch = []
            for c in rng.choice(
                self.classes, size=self.classes_per_batch, replace=self.classes_with_replacement
            ):
                pool = self.by_class[c]
                replace = self.images_with_replacement or pool.size < self.samples_per_class
                batch.extend(
                    rng.choice(pool, size=self.samples_per_class, replace=replace).tolist()
                )
            if self.sample_seeds:
                seeds = np.random.SeedSequence([self.seed, self.epoch, number]).generate_state(
                    len(batch)
                )
                batch = list(zip(batch, seeds.tolist(), strict=True))
            yield batch[start : start + share]


class ShuffledBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` images cut from a random permutation of the training
    images, the last partial batch dropped: PyTorch's ``DataLoader(shuffle=True,
    drop_last=True)``, what GeDML's trainer does when its configuration names no sampler
    (zbr17/GeDML src/gedml/launcher/trainers/base_trainer.py lines 206-212, ``shuffle=
    self.sampler is None``; AVSL's ProxyAnchor configurations name none, zbr17/AVSL
    examples/config/links/link_avsl_proxyanchor.yaml lines 49-50). A batch's classes and
    their counts are then whatever the draw gives.

    The permutation depends only on ``(seed, epoch)``; ``batches_per_epoch`` (0: N //
    batch size) takes that many batches, drawing a further permutation when one runs out.
    Across ``world_size`` processes each yields the ``rank``-th equal share of the global
    batch; ``sample_seeds`` as in :class:`ClassBalancedBatchSampler`."""

    def __init__(
        self,
        labels: np.ndarray,
        *,
        batch_size: int,
        batches_per_epoch: int = 0,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        sample_seeds: bool = False,
    ):
        self.size = len(labels)
        if batch_size > self.size:
            raise HarnessError(
                f"a batch of {batch_size} images does not fit in the {self.size} training images"
            )
        if world_size < 1 or not 0 <= rank < world_size or batch_size % world_size:
            raise HarnessError(
                f"rank {rank} of world size {world_size}: need 0 <= rank < world_size and a "
                f"batch ({batch_size}) that splits evenly across the processes"
            )
        self.batch_size = batch_size
        self.num_batches = batches_per_epoch or max(1, self.size // batch_size)
        self.seed, self.epoch = seed, 0
        self.rank, self.world_size, self.sample_seeds = rank, world_size, sample_seeds

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[Any]]:  # indices, or (index, seed) pairs
        rng = np.random.default_rng([self.seed, self.epoch])
        share = self.batch_size // self.world_size
        start = self.rank * share
        order, used = rng.permutation(self.size), 0
        for number in range(self.num_batches):
            if used + self.batch_size > self.size:
                order, used = rng.permutation(self.size), 0
            batch = order[used : used + self.batch_size].tolist()
            used += self.batch_size
            if self.sample_seeds:
                seeds = np.random.SeedSequence([self.seed, self.epoch, number]).generate_state(
                    len(batch)
                )
                batch = list(zip(batch, seeds.tolist(), strict=True))
            yield batch[start : start + share]


def batch_sampler(
    sampling,
    labels: np.ndarray,
    *,
    classes_per_batch: int,
    samples_per_class: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    sample_seeds: bool = False,
    loss: str = "",
):
    """The protocol's batch sampler for a run of ``loss`` (``sampling``: its
    :class:`~harness.config.sections.SamplingSpec`; ``classes_per_batch`` x
    ``samples_per_class`` as adapted to the split): class-balanced batches, or shuffled
    ones of the same size where ``sampling.sampler_for(loss)`` is ``"shuffle"``."""
    if sampling.sampler_for(loss) == "shuffle":
        return ShuffledBatchSampler(
            labels,
            batch_size=classes_per_batch * samples_per_class,
            batches_per_epoch=sampling.batches_per_epoch,
            seed=seed,
            rank=rank,
            world_size=world_size,
            sample_seeds=sample_seeds,
        )
    return ClassBalancedBatchSampler(
        labels,
        classes_per_batch=classes_per_batch,
        samples_per_class=samples_per_class,
        batches_per_epoch=sampling.batches_per_epoch,
        seed=seed,
        rank=rank,
        world_size=world_size,
        sample_seeds=sample_seeds,
        classes_with_replacement=sampling.classes_with_replacement,
        images_with_replacement=sampling.images_with_replacement,
    )


class TransformedImages(Dataset):
    """``(image tensor, label, index)`` from an :class:`ImageSet` and a transform.

    An item asked for as ``(index, seed)`` is transformed under torch's CPU generator
    seeded with ``seed`` (the generator's state is restored afterwards, so the caller's
    random stream is untouched)."""

    def __init__(self, images, transform, label_map: dict[int, int] | None = None):
        self.images = images
        self.transform = transform
        self.label_map = label_map

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, item: int | tuple[int, int]):
        index, seed = item if isinstance(item, tuple) else (item, None)
        label = int(self.images.labels[index])
        if self.label_map is not None:
            label = self.label_map[label]
        image = self.images.read(index)
        if seed is None:
            return self.transform(image), torch.tensor(label), index
        state = torch.get_rng_state()
        try:
            torch.default_generator.manual_seed(seed)  # the CPU generator only (no CUDA seeding)
            return self.transform(image), torch.tensor(label), index
        finally:
            torch.set_rng_state(state)
