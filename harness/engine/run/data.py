"""A run's data: its splits (loaded, capped, validation carved) and the training
batches (class-balanced, augmented per image, loaded ahead of the step)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch.utils.data import DataLoader

from harness.base.errors import HarnessError
from harness.components.data import (
    DATASETS,
    DatasetSplits,
    cap_per_class,
    carve_validation,
    check_fold_count,
    seen_class_control,
    shuffled_label_control,
)
from harness.components.data.sampling import (
    ClassBalancedBatchSampler,
    ShuffledBatchSampler,
    TransformedImages,
    batch_sampler,
)
from harness.components.data.transforms import build_transform
from harness.config.protocol import Protocol, check_batch_fits
from harness.engine.run.distributed import SINGLE_PROCESS, Processes
from harness.engine.run.embedding import loader_worker_init

__all__ = [
    "training_splits",
    "prepare_splits",
    "check_folds_fit",
    "check_training_split",
    "adapted_sampling",
    "TrainingBatches",
    "CONTROLS",
    "control_deviation",
    "recorded_control",
]

#: The diagnostic controls a run can train as (``run --seen-class-control``,
#: ``--shuffled-labels-control``): name -> (the deviation's protocol value, its value).
CONTROLS = {
    "seen-class": ("training classes", "seen-class control"),
    "shuffled-labels": ("training labels", "shuffled-labels control"),
}


def control_deviation(control: str) -> tuple[str, str, str]:
    """The deviation a control run records: (field, protocol value, value)."""
    protocol_value, value = CONTROLS[control]
    return ("splits.train", protocol_value, value)


def recorded_control(deviations: str) -> str:
    """The control a run trained as, from its ``deviations`` tag ("" for none)."""
    for name, (_, value) in CONTROLS.items():
        if value in deviations:
            return name
    return ""


def training_splits(
    protocol: Protocol,
    dataset: str,
    data_root: Path | None,
    *,
    control: str = "",
    seed: int | None = None,
) -> DatasetSplits:
    """The splits a run trains and is evaluated on (:func:`prepare_splits`), the protocol's
    rules that need them checked (its batch fits in the training split): what ``run``,
    ``sweep`` and ``tune`` hand :func:`~harness.engine.run.training.train_run`."""
    splits = prepare_splits(protocol, dataset, data_root, control=control, seed=seed)
    check_training_split(protocol, dataset, splits)
    return splits


def prepare_splits(
    protocol: Protocol,
    dataset: str,
    data_root: Path | None,
    *,
    control: str = "",
    seed: int | None = None,
) -> DatasetSplits:
    """Load the dataset, cap images per class (small protocols) and carve validation classes
    (unless the dataset gives its own validation split, as a CSV's ``validation`` rows do).

    ``control`` (:data:`CONTROLS`, diagnostics recorded as deviations): ``"seen-class"``
    swaps the training images for other images of the test classes
    (:func:`~harness.components.data.seen_class_control`), ``"shuffled-labels"`` permutes
    the training labels (:func:`~harness.components.data.shuffled_label_control`).
    ``seed``: the run's seed, which carves the validation classes when the protocol sets
    ``splits.validation_by_run_seed`` (then it is required; else it is not used).
    """
    protocol = protocol.for_dataset(dataset)
    s = protocol.splits
    if s.validation_by_run_seed and seed is None:
        raise HarnessError(
            f"protocol '{protocol.name}' carves its validation classes with the run's seed "
            f"(splits.validation_by_run_seed): its splits need the seed of the run"
        )
    splits = DATASETS.get(dataset).load(data_root)
    test_pool = splits.test
    splits.train = cap_per_class(splits.train, s.max_train_images_per_class, s.seed)
    splits.test = cap_per_class(splits.test, s.max_test_images_per_class, s.seed)
    if splits.val is not None:  # given by the dataset (a CSV's validation rows): not carved
        splits.val = cap_per_class(splits.val, s.max_train_images_per_class, s.seed)
    elif protocol.selection.mode == "validation":
        splits = carve_validation(
            splits, s.validation_classes, cast(int, seed) if s.validation_by_run_seed else s.seed
        )
    if control == "seen-class":
        splits = seen_class_control(splits, test_pool, s.max_train_images_per_class, s.seed)
    elif control == "shuffled-labels":
        splits = shuffled_label_control(splits, s.seed)
    elif control:
        raise HarnessError(f"unknown control {control!r}: expected one of {', '.join(CONTROLS)}")
    return splits


def check_folds_fit(dataset: str, data_root: Path | None, folds: int) -> None:
    """``folds`` class-disjoint folds of the dataset's training classes, checked from what
    the dataset tells without loading or generating its images: its training classes
    (the synthetic set, before it is generated; a dataset given by its path) and whether
    it gives its own validation split (:func:`~harness.components.data.check_fold_count`).
    A dataset that tells neither is checked once loaded
    (:func:`~harness.components.data.check_fold_splits`)."""
    if folds < 2:
        return
    info = DATASETS.get(dataset)
    classes = info.train_classes(data_root) if info.train_classes is not None else None
    check_fold_count(folds, classes, own_validation=info.val_given)


def check_training_split(protocol: Protocol, dataset: str, splits: DatasetSplits) -> None:
    """The protocol's rules that need the training split (its batch fits in it), checked
    before a run is tracked: a batch larger than the split would be drawn all the same."""
    check_batch_fits(
        protocol, dataset, images=len(splits.train), classes=len(np.unique(splits.train.labels))
    )


def adapted_sampling(protocol: Protocol, num_classes: int) -> tuple[int, int, str]:
    """``(classes per batch, images per class, note)`` for a split of ``num_classes``: the
    protocol's, except when the split has fewer classes than a batch asks for. Then every
    batch takes all of them, with more images each: as many as keep the batch within the
    protocol's size, and at least the protocol's samples per class; ``note`` says so."""
    s = protocol.sampling
    if num_classes >= s.classes_per_batch:
        return s.classes_per_batch, s.samples_per_class, ""
    per_class = max(s.samples_per_class, s.batch_size // num_classes)
    note = (
        f"{num_classes} classes x {per_class} per batch (protocol asks "
        f"{s.classes_per_batch} x {s.samples_per_class}; the split has {num_classes} classes)"
    )
    return num_classes, per_class, note


@dataclass
class TrainingBatches:
    """The training split as batches: the class-balanced sampler (re-seeded per epoch),
    the loader over it and, when the split forced a smaller batch layout, a note saying so."""

    sampler: ClassBalancedBatchSampler | ShuffledBatchSampler
    #: Built once: with workers, they persist across epochs (each image's augmentation
    #: seed comes with its index from the sampler, so persistence changes no crop).
    loader: DataLoader
    sampling_note: str = ""

    @classmethod
    def build(
        cls,
        protocol: Protocol,
        splits: DatasetSplits,
        *,
        seed: int,
        device: torch.device,
        workers: int = 0,
        procs: Processes = SINGLE_PROCESS,
        loss_name: str = "",
    ) -> TrainingBatches:
        """Batches of ``splits.train`` for a run of ``seed`` and ``loss_name`` (the protocol's
        sampler for it): this process's share of each batch under ``procs``, decoded and
        augmented by ``workers`` processes."""
        label_ids = np.unique(splits.train.labels)
        classes_per_batch, per_class, note = adapted_sampling(protocol, len(label_ids))
        sampler = batch_sampler(
            protocol.sampling,
            splits.train.labels,
            classes_per_batch=classes_per_batch,
            samples_per_class=per_class,
            seed=seed,
            rank=procs.rank,
            world_size=procs.world_size,
            sample_seeds=True,
            loss=loss_name,
        )
        # Losses with per-class parameters (proxies, margin beta) need labels 0..C-1.
        label_map = {int(c): i for i, c in enumerate(label_ids)}
        train_data = TransformedImages(
            splits.train, build_transform(protocol.image, train=True), label_map
        )
        # Pinned host memory (asynchronous copies to the GPU), workers kept across epochs, and
        # four batches prepared ahead per worker, so that a step never waits for its data.
        loader = DataLoader(
            train_data,
            batch_sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=device.type == "cuda",
            prefetch_factor=4 if workers > 0 else None,
            worker_init_fn=loader_worker_init,
        )
        return cls(sampler, loader, note)
