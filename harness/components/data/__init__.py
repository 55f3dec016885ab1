"""Datasets: registry, official-layout loaders, the embedded synthetic set, your own
folders and CSVs (:mod:`harness.components.data.own`), sampling, transforms."""

from harness.components.data import benchmarks, fashion_mnist, synthetic  # noqa: F401  (fill the registry)
from harness.components.data.base import (
    DATASETS,
    ArrayImageSet,
    DatasetSplits,
    FileImageSet,
    ImageSet,
    cap_per_class,
    carve_validation,
    default_data_root,
    indices_by_class,
    seen_class_control,
    shuffled_label_control,
)
from harness.components.data.folds import (
    SealedImageSet,
    SealedSplitRead,
    check_fold_count,
    check_fold_splits,
    class_folds,
    fold_splits,
    seal_test,
)

__all__ = [
    "DATASETS",
    "ArrayImageSet",
    "DatasetSplits",
    "FileImageSet",
    "ImageSet",
    "carve_validation",
    "cap_per_class",
    "seen_class_control",
    "shuffled_label_control",
    "default_data_root",
    "indices_by_class",
    "class_folds",
    "check_fold_count",
    "check_fold_splits",
    "fold_splits",
    "seal_test",
    "SealedImageSet",
    "SealedSplitRead",
]
