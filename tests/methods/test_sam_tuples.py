"""SAM's tuple selection in its parallel form on the device (``selection="device"``):
the same tuples, in the same order, as the greedy pass on the host."""

from __future__ import annotations

import pytest
import torch

from harness.methods.sam import SAMHead
from harness.methods.sam_tuples import (
    DEVICE_ROUNDS,
    candidate_tuples,
    disjoint_on_device,
    select_tuples,
    settle_rounds,
)
from tests.methods.sam_references import random_mined_batch


def test_a_small_case_by_hand():
    """In the order 1, 0, 2, 3: (1, 2) is kept, (0, 1) and (2, 3) share an image with it,
    (3, 4) is kept; the row (5, 5) repeats an image and is never kept."""
    cand = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [5, 5]])
    order = torch.tensor([1, 0, 2, 3, 4])
    kept = disjoint_on_device(cand, order, batch=6)
    assert kept.tolist() == [False, True, False, True, False]


def test_each_round_settles_the_earliest_undecided_candidate():
    """A chain in which every candidate waits for the one before it: one round keeps the
    first only; the rest stay undecided (not kept) until enough rounds have run."""
    cand = torch.tensor([[i, i + 1] for i in range(8)])  # neighbours share an image
    order = torch.arange(7, -1, -1)  # last first: each waits for its right neighbour
    kept, undecided = settle_rounds(cand, order, batch=9, rounds=1)
    assert kept.tolist() == [False] * 7 + [True] and undecided.sum() == 7
    full = disjoint_on_device(cand, order, batch=9, rounds=len(cand))
    assert full.tolist() == [i % 2 == 1 for i in range(8)]
    assert not settle_rounds(cand, order, batch=9, rounds=len(cand))[1].any()


@pytest.mark.parametrize("form", ["triplet", "siamese"])
@pytest.mark.parametrize("mining", ["random", "hardest"])
def test_the_device_form_keeps_the_host_s_tuples_on_seeded_batches(form, mining):
    """Seeded batches of 12-40 images and mined subsets (or every triplet): the same tuples
    in the same order, and torch's generator advanced alike (the random order is the same
    CPU draw)."""
    chosen = 0
    for seed in range(16):
        indices, labels, emb = random_mined_batch(seed)
        torch.manual_seed(seed)
        host = select_tuples(indices, labels, form, emb, mining)
        after_host = torch.rand(3)
        torch.manual_seed(seed)
        device = select_tuples(indices, labels, form, emb, mining, selection="device")
        assert torch.equal(device, host), (seed, device.tolist(), host.tolist())
        assert torch.equal(torch.rand(3), after_host)
        chosen += len(host)
    assert chosen > 16


def test_the_fixed_rounds_settle_every_candidate_of_a_full_batch():
    """Every triplet of a 16 x 2 batch (960 candidates) in random orders: settled well
    within DEVICE_ROUNDS (benchmarks/bench_sam_tuples.py measures larger batches)."""
    labels = torch.arange(16).repeat_interleave(2)
    cand = candidate_tuples(None, labels, "triplet")
    for seed in range(5):
        order = torch.randperm(len(cand), generator=torch.Generator().manual_seed(seed))
        kept, undecided = settle_rounds(cand, order, batch=32, rounds=DEVICE_ROUNDS)
        assert not undecided.any() and kept.any()
        images = cand[kept].flatten()
        assert len(images.unique()) == len(images)  # never an image twice


def test_quadruplets_stay_on_the_host():
    with pytest.raises(ValueError, match="selection"):
        SAMHead(channels={"s32": 8}, embedding_size=4, form="quadruplet", selection="device")
    with pytest.raises(ValueError, match="selection"):
        select_tuples(None, torch.tensor([0, 0, 1, 1, 2]), "quadruplet", selection="device")
