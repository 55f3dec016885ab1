"""The sync-free reducers equal pytorch-metric-learning's on random batches: in value
(bitwise for the divisor reducer, which does PML's very operations; to float32 rounding for
the masked mean, whose sum runs over the zeros PML drops), in gradient, and in the cases
PML branches on (a zero divisor, no loss above the threshold), while reading nothing
from the device."""

from __future__ import annotations

import pytest
import torch
from pytorch_metric_learning.reducers import (
    AvgNonZeroReducer,
    DivisorReducer,
    MeanReducer,
    ThresholdReducer,
)

from harness.base.syncs import SyncCounter
from harness.components.losses import LOSSES, MetricLoss, check_loss_args, create_loss, create_miner
from harness.components.losses.sync_free_reducers import (
    SyncFreeAvgNonZeroReducer,
    SyncFreeDivisorReducer,
    SyncFreeThresholdReducer,
    sync_free_reducer,
)


def _batch(seed: int, n: int = 12, zero_fraction: float = 0.5, requires_grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(n, 8, generator=g, requires_grad=requires_grad)
    raw = torch.randn(n, generator=g).relu() * (torch.rand(n, generator=g) > zero_fraction)
    losses = raw + embeddings.sum(1) * 0 + (embeddings[:, 0] * raw)  # a graph to the embeddings
    return embeddings, losses


def _reduce(reducer, losses, embeddings, *, divisor=None):
    info = {"losses": losses, "indices": torch.arange(len(losses)), "reduction_type": "element"}
    if divisor is not None:
        info["divisor"] = divisor
    return reducer({"loss": info}, embeddings, None)


def _value_and_grad(reducer, seed, **kwargs):
    embeddings, losses = _batch(seed, **{k: v for k, v in kwargs.items() if k == "zero_fraction"})
    divisor = kwargs.get("divisor")
    if callable(divisor):
        divisor = divisor(losses)
    value = _reduce(reducer, losses, embeddings, divisor=divisor)
    value.backward()
    return value.detach(), embeddings.grad


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "divisor", [lambda losses: torch.sum(losses > 0), lambda losses: torch.tensor(0), 7, 0]
)
def test_divisor_reducer_is_pmls_bitwise(seed, divisor):
    expected = _value_and_grad(DivisorReducer(), seed, divisor=divisor)
    got = _value_and_grad(SyncFreeDivisorReducer(), seed, divisor=divisor)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "zero_fraction", [0.0, 0.5, 1.0]
)  # 1.0: no loss above zero, PML's zero branch
def test_avg_non_zero_reducer_is_pmls(seed, zero_fraction):
    expected = _value_and_grad(AvgNonZeroReducer(), seed, zero_fraction=zero_fraction)
    got = _value_and_grad(SyncFreeAvgNonZeroReducer(), seed, zero_fraction=zero_fraction)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=0)
    if zero_fraction == 1.0:
        assert got[0].item() == 0.0


@pytest.mark.parametrize("low,high", [(0.1, None), (None, 0.8), (0.2, 0.9)])
def test_threshold_reducer_is_pmls(low, high):
    expected = _value_and_grad(ThresholdReducer(low=low, high=high), 3)
    got = _value_and_grad(SyncFreeThresholdReducer(low=low, high=high), 3)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_float16_losses_keep_pmls_value_and_dtype():
    """The float16 path (PML's NaN rescue re-sums in float32) gives PML's value and dtype."""
    losses = torch.rand(9, generator=torch.Generator().manual_seed(1)).half()
    embeddings = torch.zeros(9, 2, dtype=torch.float16)
    for divisor in (3, 0, torch.tensor(5)):
        expected = DivisorReducer().sum_and_divide(losses, embeddings, divisor)
        got = SyncFreeDivisorReducer().sum_and_divide(losses, embeddings, divisor)
        assert torch.equal(got, expected) and got.dtype == expected.dtype


def test_reducers_read_nothing_from_the_device():
    embeddings, losses = _batch(0)
    with SyncCounter() as counter:
        _reduce(SyncFreeDivisorReducer(), losses, embeddings, divisor=torch.sum(losses > 0))
        _reduce(SyncFreeAvgNonZeroReducer(), losses, embeddings)
    assert counter.syncs == 0 and counter.shape_dependent == 0
    with SyncCounter() as counter:  # the counter sees PML's reads
        _reduce(DivisorReducer(), losses, embeddings, divisor=torch.sum(losses > 0))
        _reduce(AvgNonZeroReducer(), losses, embeddings)
    assert counter.scalar_reads >= 1 and counter.shape_dependent >= 1


def test_sync_free_reducer_keeps_settings_and_leaves_others_alone():
    swapped = sync_free_reducer(AvgNonZeroReducer(collect_stats=False))
    assert type(swapped) is SyncFreeAvgNonZeroReducer and swapped.low == 0 and swapped.high is None
    mean = MeanReducer()  # no counterpart: returned as it is
    assert sync_free_reducer(mean) is mean


@pytest.mark.parametrize("name", [n for n in LOSSES.list() if not LOSSES.get(n).needs_classes])
def test_every_pair_and_triplet_loss_keeps_pmls_value(name):
    """Each registered loss (built by ``create_loss``, reducers swapped) against the same
    loss with PML's own reducers, on the tuples of a miner."""
    g = torch.Generator().manual_seed(5)
    embeddings = torch.nn.functional.normalize(torch.randn(16, 8, generator=g), dim=1)
    labels = torch.arange(8).repeat_interleave(2)
    ours = create_loss(name, num_classes=8, embedding_size=8)
    pml = LOSSES.get(name).cls(**check_loss_args(name))
    miner = create_miner("batch_hard")
    for indices in (None, miner(embeddings, labels)):
        got, expected = ours(embeddings, labels, indices), pml(embeddings, labels, indices)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["margin", "proxy_anchor"])
def test_losses_with_class_parameters_keep_pmls_value(name):
    g = torch.Generator().manual_seed(9)
    embeddings = torch.randn(16, 8, generator=g)
    labels = torch.arange(8).repeat_interleave(2)
    torch.manual_seed(0)
    ours = create_loss(name, num_classes=8, embedding_size=8)
    torch.manual_seed(0)
    pml = LOSSES.get(name).cls(
        **check_loss_args(name),
        num_classes=8,
        **({"embedding_size": 8} if name == "proxy_anchor" else {}),
    )
    got = MetricLoss(ours, create_miner("batch_hard"))(embeddings, labels)
    expected = MetricLoss(pml, create_miner("batch_hard"))(embeddings, labels)
    assert torch.equal(got, expected)
