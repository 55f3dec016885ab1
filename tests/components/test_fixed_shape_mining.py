"""Fixed-shape mining: the same tuples as the indexed miners where every anchor is kept,
the same distribution where some are not, and losses over a mask equal to PML's losses
over the valid slots; no operation with a data-dependent shape or a read of the device."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import miners as pml_miners

from harness.base.syncs import SyncCounter
from harness.components.losses import (
    FixedDistanceWeightedMiner,
    IndexedRothDistanceWeightedMiner,
    MinedTriplets,
    RothDistanceWeightedMiner,
    apply_loss,
    create_loss,
    create_miner,
    hard_triplet_indices,
    hard_triplets,
)


def _batch(seed: int, classes: int = 6, per_class: int = 3, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes * per_class) // per_class
    centres = torch.randn(classes, dim, generator=g)
    emb = F.normalize(centres[labels] + 0.8 * torch.randn(len(labels), dim, generator=g), dim=1)
    return emb, labels


def _seeded(seed: int, function, *args):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return function(*args)


# ----------------------------------------------------- the same tuples as the indexed miners


@pytest.mark.parametrize("seed", range(8))
def test_the_roth_miner_draws_the_indexed_miners_triplets_on_a_balanced_batch(seed):
    emb, labels = _batch(seed)
    fixed = _seeded(seed, RothDistanceWeightedMiner(), emb, labels)
    indexed = _seeded(seed, IndexedRothDistanceWeightedMiner(), emb, labels)
    assert isinstance(fixed, MinedTriplets) and len(fixed) == len(labels) and fixed.valid.all()
    for got, want in zip(fixed.compact(), indexed, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(8))
def test_the_hard_selector_draws_the_indexed_selectors_triplets(seed):
    emb, labels = _batch(seed)
    dist = torch.cdist(emb, emb)
    fixed = _seeded(seed, lambda: hard_triplets(dist, labels, cutoff=0.5))
    indexed = _seeded(seed, lambda: hard_triplet_indices(dist, labels, cutoff=0.5))
    for got, want in zip(fixed.compact(), indexed, strict=True):
        assert torch.equal(got, want)


def test_an_anchor_without_a_positive_is_a_slot_that_is_not_valid():
    emb, labels = _batch(0)
    labels = labels.clone()
    labels[0] = 99  # a class of one
    fixed = RothDistanceWeightedMiner()(emb, labels)
    assert len(fixed) == len(labels) and fixed.valid.tolist() == [False] + [True] * 17
    dist = torch.cdist(emb, emb)
    assert hard_triplets(dist, labels).valid.tolist() == [False] + [True] * 17


# ----------------------------------------------------- the same distribution


def _triplet_frequencies(miner, emb, labels, draws: int) -> torch.Tensor:
    """Mean count of each (a, p, n) triplet per call of ``miner`` over ``draws`` calls."""
    size = len(labels)
    counts = torch.zeros(size, size, size, dtype=torch.float64)
    for _ in range(draws):
        mined = miner(emb, labels)
        a, p, n = mined.compact() if isinstance(mined, MinedTriplets) else mined
        counts.index_put_((a, p, n), torch.ones(len(a), dtype=torch.float64), accumulate=True)
    return counts / draws


def _pml_expected_frequencies(emb, labels, cutoff=0.5, upper=1.4) -> torch.Tensor:
    """PML's DistanceWeightedMiner by its definition: per anchor k = its class's size
    triplets, p uniform among the other same-class items, n with weight q(d)^-1 (d clamped
    at ``cutoff``, zero from ``upper``); an anchor whose negatives weigh nothing gets none."""
    size, dim = len(labels), emb.size(1)
    d = torch.cdist(emb.double(), emb.double()).clamp(min=cutoff)
    w = d ** (2 - dim) * (1 - d**2 / 4) ** (-(dim - 3) / 2)
    w = torch.where((labels[:, None] != labels[None, :]) & (d < upper), w, torch.zeros_like(w))
    expected = torch.zeros(size, size, size, dtype=torch.float64)
    for a in range(size):
        others = [p for p in range(size) if labels[p] == labels[a] and p != a]
        if not others or w[a].sum() == 0:
            continue
        k = len(others) + 1
        for p in others:
            expected[a, p] = k / len(others) * w[a] / w[a].sum()
    return expected


@pytest.mark.parametrize("miner_name", ["distance_weighted", "distance_weighted_fixed"])
def test_pml_distance_weighted_sampling_and_its_fixed_shape_draw_the_same_distribution(miner_name):
    """Both miners against PML's definition, over 3,000 seeded draws each: every triplet's
    mean count within 5 standard errors (a Poisson count's), on a batch where one anchor's
    negatives are all beyond the upper cutoff and one class has a single item."""
    torch.manual_seed(0)
    emb, labels = _batch(3, classes=3, per_class=3, dim=4)
    labels = torch.cat([labels, torch.tensor([7])])
    emb = torch.cat([emb, F.normalize(torch.randn(1, 4), dim=1)])
    expected = _pml_expected_frequencies(emb, labels)
    draws = 3000
    got = _triplet_frequencies(create_miner(miner_name), emb, labels, draws)
    error = (expected / draws).sqrt().clamp(min=1 / draws)
    assert ((got - expected).abs() <= 5 * error + 1e-12).all()
    assert expected[-1].sum() == 0 and got[-1].sum() == 0  # the single item anchors nothing


def test_the_roth_miner_s_fixed_shape_keeps_its_distribution_with_skipped_anchors():
    torch.manual_seed(1)
    emb, labels = _batch(4, classes=3, per_class=3, dim=4)
    labels = labels.clone()
    labels[0] = 9  # anchor 0 is skipped, so the two forms' draws no longer line up
    draws = 3000
    fixed = _triplet_frequencies(RothDistanceWeightedMiner(), emb, labels, draws)
    indexed = _triplet_frequencies(IndexedRothDistanceWeightedMiner(), emb, labels, draws)
    error = ((fixed + indexed) / draws).sqrt().clamp(min=1 / draws)
    assert ((fixed - indexed).abs() <= 5 * error).all()
    assert fixed[0].sum() == 0 and torch.allclose(
        fixed.sum(dim=(1, 2))[1:], torch.ones(8, dtype=torch.float64)
    )


def test_the_expected_margin_loss_is_the_same_with_either_distance_weighted_form():
    torch.manual_seed(2)
    emb, labels = _batch(5, classes=4, per_class=3, dim=8)
    loss = create_loss("margin", num_classes=4, embedding_size=8)
    values = {}
    for name in ("distance_weighted", "distance_weighted_fixed"):
        miner = create_miner(name)
        with torch.no_grad():
            values[name] = torch.stack(
                [apply_loss(loss, emb, labels, miner(emb, labels)) for _ in range(1500)]
            ).double()
    a, b = values["distance_weighted"], values["distance_weighted_fixed"]
    standard_error = math.sqrt((a.var() + b.var()).item() / 1500)
    assert abs(a.mean().item() - b.mean().item()) < 5 * standard_error


# ----------------------------------------------------- losses over a mask


def _random_triplets(emb, labels, seed: int, invalid: float) -> MinedTriplets:
    """Roth's triplets (every slot valid on a balanced batch) for ``invalid`` 0; else PML's
    in a fixed shape (k of B slots valid per anchor), each slot dropped with that chance."""
    if invalid == 0.0:
        return _seeded(seed, RothDistanceWeightedMiner(), emb, labels)
    mined = _seeded(seed, FixedDistanceWeightedMiner(), emb, labels)
    drop = torch.rand(len(mined), generator=torch.Generator().manual_seed(seed)) < invalid
    return MinedTriplets(mined.anchors, mined.positives, mined.negatives, mined.valid & ~drop)


LOSS_SETTINGS = [
    ("margin", {}),
    ("margin", {"nu": 0.01}),
    ("margin", {"reduction": "dgml"}),
    ("margin", {"reduction": "roth"}),
    ("margin", {"triplets_per_anchor": "all", "learn_beta": False}),
    ("triplet", {}),
    ("triplet", {"smooth_loss": True, "swap": True}),
    ("contrastive", {}),
    ("contrastive", {"reduction": "dgml"}),
    ("binomial_deviance", {}),  # no masked form: PML's on the valid slots
]


@pytest.mark.parametrize("name,args", LOSS_SETTINGS)
@pytest.mark.parametrize("invalid", [0.0, 0.5, 1.0])
def test_a_loss_over_the_mask_equals_pml_over_the_valid_slots(name, args, invalid):
    emb, labels = _batch(11, classes=5, per_class=4)
    for seed in range(3):
        mined = _random_triplets(emb, labels, seed, invalid)
        values, grads = [], []
        for indices in (mined, mined.compact()):
            x = emb.clone().requires_grad_()
            loss = create_loss(name, args, num_classes=5, embedding_size=emb.size(1))
            value = apply_loss(loss, x, labels, indices)
            value.backward()
            values.append(value.detach())
            grads.append(x.grad)
        if invalid == 0.0:  # every slot valid: the same sums in the same order
            assert mined.valid.all()
            assert torch.equal(values[0], values[1]), (values, seed)
        assert torch.allclose(values[0], values[1], rtol=1e-6, atol=1e-7), (values, seed)
        assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7), seed


def test_pml_refuses_fixed_shape_tuples_instead_of_reading_them_as_pairs():
    emb, labels = _batch(0)
    loss = create_loss("contrastive", num_classes=6, embedding_size=8)
    with pytest.raises(TypeError):
        loss(emb, labels, RothDistanceWeightedMiner()(emb, labels))


# ----------------------------------------------------- no data-dependent shape


@pytest.mark.parametrize(
    "miner_name", ["distance_weighted_fixed", "distance_weighted_roth", "hard_negative"]
)
@pytest.mark.parametrize("loss_name", ["margin", "triplet", "contrastive"])
def test_fixed_shape_mining_and_its_loss_never_wait_on_the_device(miner_name, loss_name):
    emb, labels = _batch(2)
    emb.requires_grad_()
    loss = create_loss(loss_name, num_classes=6, embedding_size=8)
    miner = create_miner(miner_name)
    with SyncCounter() as counter:
        apply_loss(loss, emb, labels, miner(emb.detach(), labels)).backward()
    assert (counter.shape_dependent, counter.scalar_reads, counter.device_to_host) == (0, 0, 0), (
        dict(counter.ops)
    )


def test_the_indexed_miners_are_still_counted_as_data_dependent():
    emb, labels = _batch(2)
    with SyncCounter() as counter:
        create_miner("distance_weighted_roth_indexed")(emb, labels)
        create_miner("hard_negative_indexed")(emb, labels)
        pml_miners.DistanceWeightedMiner()(emb, labels)
    assert counter.shape_dependent > 0


# ----------------------------------------------------- multi-similarity pairs as masks


def _pair_mask(rows: torch.Tensor, cols: torch.Tensor, size: int) -> torch.Tensor:
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[rows, cols] = True
    return mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("distance", ["cosine", "euclidean"])
def test_the_multi_similarity_masks_keep_pmls_pairs(seed, distance):
    from pytorch_metric_learning.distances import CosineSimilarity, LpDistance

    make = {"cosine": CosineSimilarity, "euclidean": lambda: LpDistance(normalize_embeddings=True)}
    emb, labels = _batch(seed, classes=5, per_class=4)
    if seed == 5:  # a single class: no negative pair, so nothing is kept
        labels = torch.zeros_like(labels)
    fixed = create_miner("multi_similarity", {"distance": make[distance]()})(emb, labels)
    a1, p, a2, n = pml_miners.MultiSimilarityMiner(0.1, distance=make[distance]())(emb, labels)
    assert torch.equal(fixed.positive, _pair_mask(a1, p, len(labels)))
    assert torch.equal(fixed.negative, _pair_mask(a2, n, len(labels)))
    assert (seed != 5) or not (fixed.positive.any() or fixed.negative.any())


@pytest.mark.parametrize("args", [{}, {"reduction": "roth"}])
def test_the_multi_similarity_loss_over_masks_is_pmls_bit_for_bit(args):
    emb, labels = _batch(7, classes=5, per_class=4)
    values, grads = [], []
    for miner_name in ("multi_similarity", "multi_similarity_indexed"):
        x = emb.clone().requires_grad_()
        loss = create_loss("multi_similarity", args, num_classes=5, embedding_size=8)
        value = apply_loss(loss, x, labels, create_miner(miner_name)(x.detach(), labels))
        value.backward()
        values.append(value.detach())
        grads.append(x.grad)
    assert torch.equal(values[0], values[1]) and torch.equal(grads[0], grads[1])


def test_multi_similarity_mining_and_its_loss_never_wait_on_the_device():
    emb, labels = _batch(3)
    emb.requires_grad_()
    loss = create_loss("multi_similarity", num_classes=6, embedding_size=8)
    miner = create_miner("multi_similarity")
    with SyncCounter() as counter:
        apply_loss(loss, emb, labels, miner(emb.detach(), labels)).backward()
    assert (counter.shape_dependent, counter.scalar_reads, counter.device_to_host) == (0, 0, 0)
