"""Class-balanced batches, seeded per (seed, epoch)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.base.errors import HarnessError
from harness.components.data.sampling import ClassBalancedBatchSampler

LABELS = np.repeat(np.arange(10), [5, 3, 2, 8, 4, 1, 6, 2, 3, 7])


def test_batches_hold_distinct_classes_times_samples():
    sampler = ClassBalancedBatchSampler(LABELS, classes_per_batch=4, samples_per_class=2, seed=0)
    assert len(sampler) == len(LABELS) // 8
    for batch in sampler:
        classes, counts = np.unique(LABELS[batch], return_counts=True)
        assert len(batch) == 8 and len(classes) == 4 and (counts == 2).all()


def test_order_depends_only_on_seed_and_epoch():
    a = ClassBalancedBatchSampler(LABELS, classes_per_batch=4, samples_per_class=2, seed=1)
    b = ClassBalancedBatchSampler(LABELS, classes_per_batch=4, samples_per_class=2, seed=1)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    b.set_epoch(4)
    assert list(a) != list(b)


def test_too_few_classes_is_an_error():
    with pytest.raises(
        HarnessError, match="classes_per_batch=20 but the training split has only 10"
    ):
        ClassBalancedBatchSampler(LABELS, classes_per_batch=20, samples_per_class=2)


@pytest.mark.parametrize(
    "num_classes, expected", [(56, (56, 2)), (50, (50, 2)), (5, (5, 22)), (3, (3, 37))]
)
def test_a_split_with_fewer_classes_than_a_batch_keeps_the_batch_within_the_protocol_size(
    num_classes, expected
):
    from harness.config.protocol_files import load_protocol
    from harness.engine.run.data import adapted_sampling

    protocol = load_protocol("roth2020")  # 56 x 2 = 112
    classes, per_class, note = adapted_sampling(protocol, num_classes)
    assert (classes, per_class) == expected and classes * per_class <= 112
    assert bool(note) == (num_classes < 56)
