"""Losses by name through PML, the binomial deviance and quadruplet golden values, miners."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from harness.base.errors import HarnessError
from harness.components.losses import (
    LOSSES,
    MINERS,
    BinomialDevianceLoss,
    QuadrupletLoss,
    apply_loss,
    create_loss,
    create_miner,
)


def test_binomial_deviance_matches_a_hand_computation():
    """A-grouping Table 1 / DGML code: mean over positive pairs of softplus(-2(s - 0.5)) plus
    mean over negative pairs of softplus(2 * 25 (s - 0.5)); self-pairs excluded."""
    emb = F.normalize(torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-0.6, 0.8]]), dim=1)
    labels = torch.tensor([0, 0, 1, 1])
    sim = emb @ emb.T
    pos, neg = [], []
    for i in range(4):
        for j in range(4):
            if i == j:
                continue
            s = float(sim[i, j])
            if labels[i] == labels[j]:
                pos.append(math.log(1 + math.exp(-2.0 * (s - 0.5))))
            else:
                neg.append(math.log(1 + math.exp(2.0 * 25.0 * (s - 0.5))))
    expected = sum(pos) / len(pos) + sum(neg) / len(neg)
    assert float(BinomialDevianceLoss()(emb, labels)) == pytest.approx(expected, rel=1e-6)


def test_binomial_deviance_gradient_pulls_positives_together():
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    BinomialDevianceLoss()(F.normalize(emb, dim=1), torch.tensor([0, 0])).backward()
    assert emb.grad[0, 1] < 0  # moving toward the other positive lowers the loss


def test_quadruplet_loss_matches_a_hand_computation():
    """Chen et al. 2017 on Euclidean distance: mean over the non-zero triplet terms
    relu(d(a,p) - d(a,n1) + 0.2) plus mean over the non-zero quadruplet terms
    relu(d(a,p) - d(n1,n2) + 0.1), n2 of a class other than a's and n1's."""
    emb = F.normalize(
        torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-0.6, 0.8], [-1.0, 0.1], [0.3, -1.0]]),
        dim=1,
    )
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    d = torch.cdist(emb, emb)
    first, second = [], []
    for a in range(6):
        for p in range(6):
            if p == a or labels[p] != labels[a]:
                continue
            for n in range(6):
                if labels[n] == labels[a]:
                    continue
                first.append(max(0.0, float(d[a, p] - d[a, n]) + 0.2))
                for n2 in range(6):
                    if labels[n2] not in (labels[a], labels[n]):
                        second.append(max(0.0, float(d[a, p] - d[n, n2]) + 0.1))
    nonzero = lambda xs: [x for x in xs if x > 0]  # noqa: E731
    expected = sum(nonzero(first)) / len(nonzero(first)) + sum(nonzero(second)) / len(
        nonzero(second)
    )
    assert float(
        create_loss("quadruplet", num_classes=3, embedding_size=2)(emb, labels)
    ) == pytest.approx(expected, rel=1e-5)
    # Mined triplets restrict both terms to them.
    mined = (torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))
    t1 = max(0.0, float(d[0, 1] - d[0, 2]) + 0.2)
    t2 = [max(0.0, float(d[0, 1] - d[2, j]) + 0.1) for j in (4, 5)]
    expected = (t1 if t1 > 0 else 0.0) + (
        sum(nonzero(t2)) / len(nonzero(t2)) if nonzero(t2) else 0.0
    )
    assert float(QuadrupletLoss()(emb, labels, mined)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", LOSSES.list())
def test_every_loss_builds_and_backpropagates(name):
    torch.manual_seed(0)
    loss = create_loss(name, num_classes=4, embedding_size=8)
    emb = torch.randn(8, 8, requires_grad=True)
    value = loss(F.normalize(emb, dim=1), torch.arange(8) % 4)
    assert value.ndim == 0 and torch.isfinite(value)
    value.backward()
    assert emb.grad is not None and torch.isfinite(emb.grad).all()


def test_margin_loss_has_a_learnable_beta_per_class():
    loss = create_loss("margin", num_classes=5, embedding_size=8)
    (beta,) = list(loss.parameters())
    assert beta.shape == (5,) and beta.requires_grad and torch.allclose(beta, torch.full((5,), 1.2))


def test_protocol_args_override_defaults_and_unknown_args_fail():
    assert create_loss("triplet", {"margin": 0.5}, num_classes=2, embedding_size=4).margin == 0.5
    with pytest.raises(HarnessError, match="unknown argument 'margn' for loss 'triplet'"):
        create_loss("triplet", {"margn": 0.5}, num_classes=2, embedding_size=4)
    with pytest.raises(HarnessError, match="unknown loss 'tripplet'"):
        create_loss("tripplet", num_classes=2, embedding_size=4)


@pytest.mark.parametrize("name", MINERS.list())
def test_miners_compose_with_losses(name):
    miner = create_miner(name)
    emb = F.normalize(torch.randn(8, 4), dim=1)
    labels = torch.arange(8) % 4
    loss = create_loss("contrastive", num_classes=4, embedding_size=4)
    value = apply_loss(loss, emb, labels, miner(emb, labels))  # index lists or a fixed-shape mask
    assert torch.isfinite(value)
    assert create_miner("none") is None


def test_proxy_and_class_losses_take_no_miner_and_multi_similarity_mines_its_own_pairs():
    from harness.components.losses import miner_for

    args = {"cutoff": 0.5}
    for loss in ("contrastive", "triplet", "margin", "binomial_deviance"):
        assert miner_for(loss, "distance_weighted", args) == (
            "distance_weighted",
            args,
        )  # the protocol's
    for loss in ("proxy_anchor", "proxy_nca", "arcface", "normalized_softmax", "soft_triple"):
        assert miner_for(loss, "distance_weighted", args) == ("none", {})
        assert create_miner(*miner_for(loss, "distance_weighted", args)) is None
    assert miner_for("multi_similarity", "distance_weighted", args) == ("multi_similarity", {})
    # A protocol that already names the loss's own miner keeps its arguments for it.
    assert miner_for("multi_similarity", "multi_similarity", {"epsilon": 0.2}) == (
        "multi_similarity",
        {"epsilon": 0.2},
    )


def test_a_miner_would_change_a_proxy_loss():
    """Why proxy losses get no miner: PML turns the miner's tuples into sample weights."""
    torch.manual_seed(0)
    emb = F.normalize(torch.randn(8, 4), dim=1)
    labels = torch.arange(8) % 4
    loss = create_loss("proxy_anchor", num_classes=4, embedding_size=4)
    mined = create_miner("distance_weighted")(emb, labels)
    assert not torch.isclose(loss(emb, labels), loss(emb, labels, mined))


def test_roth_distance_weighted_miner_weights_by_hand():
    """Roth et al. 2020's sampler: per anchor, negatives weighted by q(d)^-1 = d^(2-n)
    (1 - d^2/4)^(-(n-3)/2) with d clamped below at 0.5 (Wu et al. 2017 Sec. 4), normalised;
    same-class items weigh nothing; no upper cutoff."""
    from harness.components.losses import RothDistanceWeightedMiner

    g = torch.Generator().manual_seed(3)
    emb = F.normalize(torch.randn(6, 4, generator=g), dim=1)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    got = RothDistanceWeightedMiner(cutoff=0.5).negative_weights(emb, labels, emb, labels)
    dim = 4
    for a in range(6):
        raw = [0.0] * 6
        for n in range(6):
            if labels[n] != labels[a]:
                d = max(0.5, float((emb[a] - emb[n]).norm()))
                raw[n] = d ** (2 - dim) * (1 - d * d / 4) ** (-(dim - 3) / 2)
        expected = [w / sum(raw) for w in raw]
        assert got[a].tolist() == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_roth_miner_has_no_upper_cutoff_and_one_triplet_per_anchor():
    """Where PML's DistanceWeightedMiner (Wu et al.'s recipe) differs: a negative beyond
    PML's nonzero_loss_cutoff (1.4) is still drawn, and each anchor gets one triplet."""
    from pytorch_metric_learning import miners as pml_miners

    # Anchor 0 and its positive 1 near e1; negative 2 at distance 1.0; negative 3 at ~1.9.
    emb = F.normalize(
        torch.tensor(
            [
                [1.0, 0.0, 0.0, 0.0],
                [0.95, 0.3, 0.0, 0.0],
                [0.5, 0.0, 0.866, 0.0],
                [-0.8, 0.0, 0.0, 0.6],
            ]
        ),
        dim=1,
    )
    labels = torch.tensor([0, 0, 1, 2])
    assert float((emb[0] - emb[3]).norm()) > 1.8
    roth, pml = create_miner("distance_weighted_roth"), pml_miners.DistanceWeightedMiner(0.5, 1.4)
    torch.manual_seed(0)
    far_roth = sum(
        int(((a == 0) & (n == 3)).any())
        for a, _, n in (roth(emb, labels).compact() for _ in range(400))
    )
    far_pml = sum(
        int(((a == 0) & (n == 3)).any()) for a, _, n in (pml(emb, labels) for _ in range(400))
    )
    # q^-1 weights in R^4: 1.155 at d = 1.0, ~0.80 at d = 1.9, so about 0.41 of the draws.
    assert 0.3 < far_roth / 400 < 0.52 and far_pml == 0
    batch = F.normalize(torch.randn(16, 8), dim=1)
    pairs = torch.arange(16) // 2  # 8 classes x 2
    a, p, n = roth(batch, pairs).compact()
    assert a.tolist() == list(range(16)) and (pairs[p] == pairs[a]).all() and (p != a).all()
    assert (pairs[n] != pairs[a]).all()
    assert len(pml(batch, pairs)[0]) == 32  # PML: two per anchor at two per class
