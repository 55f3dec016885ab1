"""``reduction = "dgml"``, which the A-grouping protocols select: the margin, contrastive and
binomial deviance losses equal, in value and in gradient, what the authors' released code
computes (XinyiXuXD/DGML-master, ``criteria/``). Each reference below transcribes that
code's arithmetic (file and line cited) on seeded batches in float64; each test also shows
that PML's default reduction gives another value on the same batch, so that it tests the
choice and not only the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.base.errors import HarnessError
from harness.components.losses import (
    MetricLoss,
    RothDistanceWeightedMiner,
    create_loss,
    loss_reductions,
)
from harness.config.grids import expand, load_grid
from harness.config.protocol_files import load_protocol
from harness.methods import TrainingBatch, create_method

DGML_LOSSES = ("margin", "contrastive", "binomial_deviance")
AGROUPING_PROTOCOLS = ("agrouping", "agrouping-googlenet", "agrouping-sec42")
CLASSES, PER_CLASS, DIM = 6, 4, 8
SEEDS = (0, 1, 2)
TOL = {"atol": 1e-5, "rtol": 0.0}


def seeded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw features (float64, requiring grad) clustered by class, so that distances spread
    over the margins and hinge terms are both active and inactive; labels 6 classes x 4."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(CLASSES * PER_CLASS) // PER_CLASS
    centres = torch.randn(CLASSES, DIM, generator=gen, dtype=torch.float64)
    raw = centres[labels] + 0.9 * torch.randn(len(labels), DIM, generator=gen, dtype=torch.float64)
    return raw.requires_grad_(), labels


def roth_triplets(unit: torch.Tensor, labels: torch.Tensor, seed: int):
    """One distance-weighted triplet per anchor, the sampler both code and protocol use."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return RothDistanceWeightedMiner()(unit.detach(), labels).compact()


def protocol_loss(
    name: str, *, protocol: str = "agrouping", num_classes: int = CLASSES, dim: int = DIM
):
    """Loss ``name`` as the protocol's ``[loss.args.<name>]`` table builds it."""
    args = load_protocol(protocol).loss_args(name)
    return create_loss(name, args, num_classes=num_classes, embedding_size=dim)


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b|: how far PML's default reduction is from the code on the same batch."""
    return abs(float(a.detach()) - float(b.detach()))


def grads(value: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(value, inputs, retain_graph=True))


def assert_same_loss_and_gradients(ours, our_inputs, reference, reference_inputs):
    torch.testing.assert_close(ours, reference, **TOL)
    for got, expected in zip(
        grads(ours, our_inputs), grads(reference, reference_inputs), strict=True
    ):
        torch.testing.assert_close(got, expected, **TOL)


# ------------------------------------------------------------ the code's arithmetic


def code_margin(unit, labels, triplets, beta, margin):
    """``criteria/margin.py``, ``Margin.margin_loss`` (l. 53-79) on one group's embeddings."""
    a, p, n = triplets
    if len(a) == 0:  # l. 77-78: no triplet, a zero
        return unit.sum() * 0
    d_ap = ((unit[a] - unit[p]).pow(2).sum(dim=1) + 1e-8).sqrt()  # l. 60
    d_an = ((unit[a] - unit[n]).pow(2).sum(dim=1) + 1e-8).sqrt()  # l. 61
    anchor_beta = beta[labels[a]]  # l. 46: the anchor's class
    pos = F.relu(d_ap - anchor_beta + margin)  # l. 67
    neg = F.relu(anchor_beta - d_an + margin)  # l. 68
    # l. 70: (pos > 0) + (neg > 0) adds two boolean tensors, a logical or: triplets counted.
    active = ((pos > 0) | (neg > 0)).sum()
    total = (pos + neg).sum()
    return total / active if active > 0 else total  # l. 72-75


def code_contrastive(unit, triplets, pos_margin, neg_margin):
    """``criteria/contrastive.py``, ``Criterion.contrastive`` (l. 29-41) on normalised
    embeddings (l. 44). ``nn.PairwiseDistance(p=2)`` adds its eps 1e-6 to the difference."""
    a, p, n = triplets
    d_ap = (unit[a] - unit[p] + 1e-6).norm(dim=1)  # l. 36
    d_an = (unit[a] - unit[n] + 1e-6).norm(dim=1)  # l. 38
    return F.relu(d_ap - pos_margin).mean() + F.relu(neg_margin - d_an).mean()  # l. 35-40


def code_binomial_deviance(features, labels, alpha, margin, neg_scale):
    """``criteria/binomial_deviance.py``, ``bd_loss`` (l. 9-22) with the masks of
    ``pair_mask(False, labels, labels)`` (l. 25-41, called at l. 57)."""
    unit = F.normalize(features, p=2, dim=-1)  # l. 12
    sim = unit @ unit.T  # l. 13
    # l. 28, 37: label equality, the diagonal kept (self_compare False, l. 33-36 skipped).
    same = (labels[:, None] == labels[None, :]).to(sim.dtype)
    other = 1.0 - same  # l. 39-40
    act = alpha * (sim - margin) * (-1.0 * same + neg_scale * other)  # l. 15-16
    floor = torch.tensor(1e-5, dtype=sim.dtype)
    weight = same / torch.max(floor, same.sum()) + other / torch.max(floor, other.sum())  # l. 18-20
    return (torch.log(torch.exp(act) + 1.0) * weight).sum()  # l. 21-22


# ------------------------------------------------------------------- one loss each


@pytest.mark.parametrize("seed", SEEDS)
def test_margin_equals_the_codes_margin_loss(seed):
    raw, labels = seeded_batch(seed)
    unit = F.normalize(raw, dim=1)
    triplets = roth_triplets(unit, labels, seed)
    loss = protocol_loss("margin").double()
    with torch.no_grad():  # per-class betas spread around 1.2, as after some training
        loss.beta.copy_(
            1.2
            + 0.15
            * torch.randn(
                CLASSES, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
            )
        )
    ours = loss(unit, labels, triplets)
    beta = loss.beta.detach().clone().requires_grad_()
    reference = code_margin(unit, labels, triplets, beta, margin=0.2)
    assert_same_loss_and_gradients(ours, [raw, loss.beta], reference, [raw, beta])
    pml = create_loss("margin", {}, num_classes=CLASSES, embedding_size=DIM).double()
    pml.load_state_dict(loss.state_dict())
    assert gap(pml(unit, labels, triplets), reference) > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_contrastive_equals_the_codes_contrastive_loss(seed):
    raw, labels = seeded_batch(seed)
    unit = F.normalize(raw, dim=1)
    triplets = roth_triplets(unit, labels, seed)
    ours = protocol_loss("contrastive")(unit, labels, triplets)
    reference = code_contrastive(unit, triplets, pos_margin=0.0, neg_margin=1.0)
    assert_same_loss_and_gradients(ours, [raw], reference, [raw])
    pml = create_loss("contrastive", {}, num_classes=CLASSES, embedding_size=DIM)
    assert gap(pml(unit, labels, triplets), reference) > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_binomial_deviance_equals_the_codes_binomial_deviance(seed):
    raw, labels = seeded_batch(seed)
    unit = F.normalize(raw, dim=1)
    ours = protocol_loss("binomial_deviance")(unit, labels)  # no miner: every pair, as the code
    reference = code_binomial_deviance(raw, labels, alpha=2.0, margin=0.5, neg_scale=25.0)
    assert_same_loss_and_gradients(ours, [raw], reference, [raw])
    pml = create_loss("binomial_deviance", {}, num_classes=CLASSES, embedding_size=DIM)
    assert gap(pml(unit, labels), reference) > 1e-3


# ------------------------------------------------------- through the A-grouping head


class RecordingMiner:
    """The protocol's miner, its draws kept so that the reference sees the same triplets."""

    def __init__(self):
        self.miner, self.draws = RothDistanceWeightedMiner(), []

    def __call__(self, embeddings, labels):
        mined = self.miner(embeddings, labels)
        self.draws.append(mined.compact())
        return mined


def test_the_agrouping_metric_term_equals_the_codes_margin_forward():
    """``criteria/margin.py`` ``Margin.forward`` (l. 40-49): per group its own triplets and
    its row of the groups x classes betas, the groups' losses summed and divided by k. Float32,
    as the trainer runs the loss; gradients reach the feature map through the head."""
    torch.manual_seed(0)
    groups = 4
    head = create_method(
        "agrouping",
        channels={"s32": 16},
        embedding_size=groups * DIM,
        groups=groups,
        diversity_weight=0.0,
    )
    fmap = torch.randn(
        CLASSES * PER_CLASS,
        16,
        3,
        3,
        generator=torch.Generator().manual_seed(1),
        requires_grad=True,
    )
    labels = torch.arange(CLASSES * PER_CLASS) // PER_CLASS
    losses = torch.nn.ModuleList(protocol_loss("margin") for _ in range(groups))
    with torch.no_grad():
        for loss in losses:
            loss.beta.copy_(1.2 + 0.15 * torch.randn(CLASSES))
    miner = RecordingMiner()
    out = head([fmap])
    ours = head.loss_terms(out, TrainingBatch(labels, MetricLoss(losses, miner)))["metric"]
    betas = [loss.beta.detach().clone().requires_grad_() for loss in losses]
    reference = (
        sum(
            code_margin(out.groups[:, p], labels, miner.draws[p], betas[p], margin=0.2)
            for p in range(groups)
        )
        / groups
    )
    assert_same_loss_and_gradients(
        ours, [fmap, *(loss.beta for loss in losses)], reference, [fmap, *betas]
    )


# ------------------------------------------------------------ where it is selected


@pytest.mark.parametrize("protocol", AGROUPING_PROTOCOLS)
def test_agrouping_protocols_select_the_codes_arithmetic(protocol):
    loaded = load_protocol(protocol)
    assert {loss: loaded.loss_args(loss).get("reduction") for loss in DGML_LOSSES} == dict.fromkeys(
        DGML_LOSSES, "dgml"
    )


@pytest.mark.parametrize("protocol", ["smoke", "roth2020"])
def test_fair_protocols_keep_pmls_reductions(protocol):
    loaded = load_protocol(protocol)
    assert all("reduction" not in loaded.loss_args(loss) for loss in DGML_LOSSES)


def test_the_agrouping_table3_grid_runs_every_loss_with_the_codes_arithmetic():
    cells = expand(load_grid("agrouping-table3"))
    assert {cell.loss for cell in cells} == set(DGML_LOSSES)
    assert {cell.loss_args.get("reduction") for cell in cells} == {"dgml"}


def test_reductions_offered():
    # "roth": Roth et al.'s criteria as DIML ships them (the margin and contrastive ones, and
    # multi-similarity's; DGML has no binomial deviance counterpart there)
    assert {loss: loss_reductions(loss) for loss in DGML_LOSSES} == {
        "margin": ["pml", "dgml", "roth"],
        "contrastive": ["pml", "dgml", "roth"],
        "binomial_deviance": ["pml", "dgml"],
    }
    assert loss_reductions("multi_similarity") == ["pml", "roth"]
    assert loss_reductions("triplet") == ["pml"]


@pytest.mark.parametrize(
    "loss, args, message",
    [
        (
            "margin",
            {"reduction": "dgm"},
            "loss 'margin': unknown reduction 'dgm'; did you mean 'dgml'? valid: dgml, pml, roth",
        ),
        ("triplet", {"reduction": "dgml"}, "loss 'triplet': unknown reduction 'dgml' valid: pml"),
        ("margin", {"reduction": "dgml", "nu": 0.1}, "no beta regulariser: nu must be 0, got 0.1"),
    ],
)
def test_a_reduction_the_loss_does_not_offer_is_an_error(loss, args, message):
    with pytest.raises(HarnessError, match=message.replace("?", r"\?")):
        create_loss(loss, args, num_classes=CLASSES, embedding_size=DIM)
