"""SAM's tuple selection in a fixed shape (``selection="fixed"``): the host's tuples in the
host's order from the same order (hardest first, or a random order handed over), the
host's distribution in random order (many seeded draws, within sampling error), no shape
that depends on the data, and L_sm over the kept slots equal to the host's L_sm."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from harness.base.syncs import SyncCounter
from harness.components.losses import create_miner
from harness.methods import sam_tuples
from harness.methods.sam_tuples import (
    candidate_slots,
    candidate_tuples,
    greedy_in_slots,
    select_fixed_tuples,
    select_tuples,
)
from tests.methods.sam_references import random_mined_batch

FORMS = ("triplet", "siamese", "quadruplet")


def _kept(rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The kept slots' tuples; the rounds keep a prefix (once none is free, none stays free)."""
    count = int(kept.sum())
    assert kept[:count].all() and not kept[count:].any()
    return rows[:count]


def _batches():
    """Seeded batches with the candidates in each form a miner hands them over: PML's index
    lists or none (``random_mined_batch``), fixed-shape triplets, the pair masks."""
    for seed in range(12):
        yield random_mined_batch(seed)
    for seed, name in enumerate(["distance_weighted_fixed", "hard_negative", "multi_similarity"]):
        _, labels, emb = random_mined_batch(seed + 1)
        torch.manual_seed(seed)
        yield create_miner(name)(emb, labels), labels, emb


@pytest.mark.parametrize("form", FORMS)
def test_hardest_first_keeps_the_host_s_tuples(form):
    kept_any = 0
    for indices, labels, emb in _batches():
        host = select_tuples(indices, labels, form, emb, "hardest")
        rows, kept = select_fixed_tuples(indices, labels, form, emb, "hardest")
        assert rows.shape == (
            len(labels) // sam_tuples.TUPLE_SIZE[form],
            len(host[0]) or rows.shape[1],
        )
        assert torch.equal(_kept(rows, kept), host), (rows.tolist(), host.tolist())
        kept_any += len(host)
    assert kept_any > 30


def test_the_slots_list_the_host_s_candidates_in_its_order():
    for indices, labels, _ in _batches():
        for form in FORMS:
            cand, valid = candidate_slots(indices, labels, form)
            assert torch.equal(cand[valid], candidate_tuples(indices, labels, form))


@pytest.mark.parametrize("form", ["triplet", "siamese"])
def test_a_random_order_handed_over_keeps_the_host_s_tuples(form):
    """The host's random order (a permutation of its candidates, the first draw from torch's
    global generator), given to the fixed form as a priority per slot: the same tuples in
    the same order."""
    for seed, (indices, labels, emb) in enumerate(_batches()):
        cand, valid = candidate_slots(indices, labels, form)
        torch.manual_seed(seed)
        order = torch.randperm(int(valid.sum()))
        torch.manual_seed(seed)  # the host draws the same permutation
        host = select_tuples(indices, labels, form, emb, "random")
        priority = torch.full((len(cand),), len(cand))
        priority[torch.nonzero(valid).flatten()[order]] = torch.arange(len(order))
        rows, kept = greedy_in_slots(cand, valid, priority, batch=len(labels), form=form)
        assert torch.equal(_kept(rows, kept), host)


def _outcomes(select, draws: int) -> Counter:
    counts: Counter = Counter()
    for seed in range(draws):
        torch.manual_seed(seed)
        counts[tuple(map(tuple, select()))] += 1
    return counts


@pytest.mark.parametrize("form", FORMS)
def test_in_random_order_the_host_s_distribution(form):
    """A batch of 3 classes x 3 images, every candidate (no miner): the frequency of each
    selection (the tuples kept, in order) over 1,500 seeded draws of either form agrees
    within 5 standard errors of the difference."""
    labels = torch.arange(3).repeat_interleave(3)
    draws = 1500
    host = _outcomes(lambda: select_tuples(None, labels, form).tolist(), draws)

    def fixed():
        rows, kept = select_fixed_tuples(None, labels, form)
        return _kept(rows, kept).tolist()

    device = _outcomes(fixed, draws)
    assert len(host) > 5
    for outcome in set(host) | set(device):
        p_host, p_device = host[outcome] / draws, device[outcome] / draws
        p = (p_host + p_device) / 2
        se = math.sqrt(2 * p * (1 - p) / draws) + 1 / draws
        assert abs(p_host - p_device) <= 5 * se, (outcome, host[outcome], device[outcome])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mining", ["random", "hardest"])
def test_the_fixed_form_reads_nothing_and_has_no_data_dependent_shape(form, mining):
    _, labels, emb = random_mined_batch(3)
    triplets = create_miner("distance_weighted_fixed")(emb, labels)
    with SyncCounter() as counter:
        rows, kept = select_fixed_tuples(triplets, labels, form, emb, mining)
    assert counter.shape_dependent == counter.scalar_reads == counter.device_to_host == 0
    images = rows[kept].flatten()
    assert len(images.unique()) == len(images)  # never an image twice


def test_a_quadruplet_s_n2_is_of_a_third_class_and_unused():
    for indices, labels, emb in _batches():
        for mining in ("random", "hardest"):
            rows, kept = select_fixed_tuples(indices, labels, "quadruplet", emb, mining)
            for a, p, n1, n2 in _kept(rows, kept).tolist():
                assert labels[n2] not in (labels[a], labels[n1]) and labels[p] == labels[a]


@pytest.mark.parametrize("form", FORMS)
def test_l_sm_over_the_kept_slots_is_the_host_s(form):
    """Hardest first (the same tuples), frozen BatchNorm as the protocols run it: the fixed
    shape's L_sm (its placeholder slots weighted 0) and its gradients are the host's."""
    from harness.components.losses import MetricLoss, create_loss
    from harness.methods import TrainingBatch
    from tests.methods.test_conformance import EMB, build, images

    name = {"triplet": "sam", "siamese": "sam_siamese", "quadruplet": "sam_quadruplet"}[form]
    labels = torch.arange(8) // 2
    x = images()
    values, grads = {}, {}
    for selection in ("host", "fixed"):
        model = build(name, mining="hardest", selection=selection).train()
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.eval()
        metric_loss = MetricLoss(create_loss("triplet", num_classes=4, embedding_size=EMB), None)
        terms = model.head.loss_terms(model(x), TrainingBatch(labels, metric_loss, x, model))
        values[selection] = terms["similarity_mining"]
        grads[selection] = torch.autograd.grad(values[selection], model.head.project.weight)[0]
    assert values["host"] != 0
    torch.testing.assert_close(values["fixed"], values["host"])
    torch.testing.assert_close(grads["fixed"], grads["host"])


def test_no_candidate_and_a_batch_smaller_than_a_tuple_keep_nothing():
    labels = torch.tensor([0, 0, 1, 1])
    none = (torch.zeros(0, dtype=torch.long),) * 3  # an index-list miner that found none
    for form in FORMS:
        rows, kept = select_fixed_tuples(none, labels, form)
        assert rows.shape == (0, sam_tuples.TUPLE_SIZE[form]) and kept.shape == (0,)
    rows, kept = select_fixed_tuples(None, labels[:3], "quadruplet")
    assert rows.shape == (0, 4)


def test_an_unkept_slot_never_reaches_the_gradient():
    """Whatever the masked pass gives an unkept slot (here NaN), L_sm and its gradient are
    the kept slots' alone."""
    from harness.methods.sam_attention import similarity_mining_loss

    features = torch.randn(3, 3, 4, generator=torch.Generator().manual_seed(0))
    features[2] = float("nan")
    features.requires_grad_()
    kept = torch.tensor([True, True, False])
    loss = similarity_mining_loss(features, "triplet", kept)
    (grad,) = torch.autograd.grad(loss, features)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and not grad[2].any()
    torch.testing.assert_close(loss, similarity_mining_loss(features[:2], "triplet"))
