"""The seeds' recipe settings that a protocol can choose (issue #36, items 1-4): GoogLeNet
as DGML-master runs it, the class samplers' draws with replacement, the query weight
decay of A-grouping Sec. 4.2, and Roth et al.'s loss arithmetic as DIML ships it. Each
test checks the setting's effect (or the reproduce protocol's effective value), so that
it fails where the setting is missing or the protocol keeps the harness's value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.base.errors import HarnessError
from harness.components.data.sampling import ClassBalancedBatchSampler
from harness.components.losses import create_loss, create_miner
from harness.config.fingerprint import fingerprint
from harness.config.grids import load_grid
from harness.config.protocol_files import load_protocol

# --------------------------------------------------------------- 1. GoogLeNet as DGML runs it


def _googlenet_cells():
    return [c for c in load_grid("agrouping-table3").cells if c.backbone == "googlenet"]


@pytest.mark.parametrize("source", ["agrouping-googlenet", "agrouping-table3"])
def test_googlenet_runs_as_dgml_master_runs_it(source):
    """DGML-master@7834411: no transform_input (architectures/googlenet.py:18-19), BatchNorm
    trained (only resnet50.py:21-24 freezes it), 227-pixel crops (basic_dataset_scaffold.py:30)."""
    protocols = (
        [load_protocol(source).for_dataset(d) for d in ("cub200", "cars196")]
        if source.endswith("googlenet")
        else [c.protocol for c in _googlenet_cells()]
    )
    assert protocols
    for protocol in protocols:
        assert protocol.backbone.name == "googlenet"
        assert protocol.backbone.input_transform is False
        assert protocol.backbone.freeze_bn is False
        assert protocol.image.size == 227 and protocol.image.resize == 256


def test_the_resnet_cells_of_table3_keep_frozen_batchnorm_and_224():
    cells = [c for c in load_grid("agrouping-table3").cells if c.backbone == "resnet50"]
    assert cells and all(
        c.protocol.backbone.freeze_bn and c.protocol.image.size == 224 for c in cells
    )
    assert all("googlenet_weights" not in c.paper_deviations for c in cells)
    assert all("googlenet_weights" in c.paper_deviations for c in _googlenet_cells())


def _fake_pretrained_googlenet(monkeypatch):
    """torchvision's GoogLeNet as its ImageNet weights configure it (transform_input on),
    with random weights: no download."""
    import torchvision.models

    real = torchvision.models.googlenet

    def fake(*, weights=None, **kwargs):
        torch.manual_seed(0)
        return real(
            weights=None, aux_logits=False, init_weights=True, transform_input=weights is not None
        )

    monkeypatch.setattr(torchvision.models, "googlenet", fake)


def test_input_transform_false_skips_torchvisions_conversion(monkeypatch):
    from harness.components.backbones import create_backbone

    _fake_pretrained_googlenet(monkeypatch)
    x = torch.randn(2, 3, 64, 64)
    converted = create_backbone("googlenet", pretrained=True).eval()
    raw = create_backbone("googlenet", pretrained=True, input_transform=False).eval()
    assert converted.body.transform_input and not raw.body.transform_input
    children = nn.Sequential(
        *list(raw.body.children())[:7]
    ).eval()  # DGML-master's Sequential, up to 3b

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))

    with torch.no_grad():
        assert close(raw.run(x, stop="s8"), children(x))
        assert not close(converted.run(x, stop="s8"), children(x))
        # torchvision's conversion: channel c becomes x * std_c / 0.5 + (mean_c - 0.5) / 0.5
        # (channel 0: 0.458 x - 0.030)
        shifted = x.clone()
        for c, (mean, std) in enumerate(
            zip((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), strict=True)
        ):
            shifted[:, c] = x[:, c] * (std / 0.5) + (mean - 0.5) / 0.5
        assert close(converted.run(x, stop="s8"), children(shifted))


def test_input_transform_false_is_refused_by_a_backbone_without_one():
    from harness.components.backbones import create_backbone

    with pytest.raises(HarnessError, match="backbone 'efficientnet_lite0' has no input transform"):
        create_backbone("efficientnet_lite0", pretrained=False, input_transform=False)


def test_trained_batchnorm_uses_batch_statistics_in_training_mode():
    from harness.components.backbones import create_backbone

    backbone = create_backbone(
        "googlenet", pretrained=False, freeze_bn=False, input_transform=False
    ).train()
    norms = [m for m in backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(m.training for m in norms)
    frozen = create_backbone("googlenet", pretrained=False, freeze_bn=True).train()
    assert not any(m.training for m in frozen.modules() if isinstance(m, nn.BatchNorm2d))


# ------------------------------------------------------------------- 2. sampler replacement


def _batches(labels, epochs=20, **kwargs):
    sampler = ClassBalancedBatchSampler(labels, classes_per_batch=56, samples_per_class=2, **kwargs)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        yield from sampler


def _repeat_rate(labels, **kwargs) -> float:
    """The fraction of (batch, class) draws whose two images are the same image."""
    same = total = 0
    for batch in _batches(labels, **kwargs):
        for i in range(0, len(batch), 2):
            same += batch[i] == batch[i + 1]
            total += 1
    return same / total


def test_images_with_replacement_repeat_an_image_at_one_over_the_class_size():
    """DGML-master@7834411 datasampler/class_random_sampler.py:43 (np.random.choice, replace
    defaulting to True): two draws from a class of 10 images coincide with probability 1/10."""
    labels = np.repeat(np.arange(100), 10)
    assert _repeat_rate(labels) == 0.0
    rate = _repeat_rate(labels, images_with_replacement=True)
    assert abs(rate - 0.1) < 0.015, rate


def test_classes_with_replacement_give_about_43_distinct_classes_of_100():
    """wl-zhao/DIML@c15dbea datasampler/class_random_sampler.py:42: 56 draws from 100 classes
    give 100 (1 - 0.99^56) = 43.0 distinct classes in expectation."""
    labels = np.repeat(np.arange(100), 10)
    distinct = [
        len({labels[i] for i in batch}) for batch in _batches(labels, classes_with_replacement=True)
    ]
    assert abs(np.mean(distinct) - 100 * (1 - 0.99**56)) < 0.5, np.mean(distinct)
    assert {len({labels[i] for i in batch}) for batch in _batches(labels)} == {56}


def test_classes_with_replacement_accept_fewer_classes_than_a_batch():
    labels = np.repeat(np.arange(20), 5)
    batch = next(
        iter(
            ClassBalancedBatchSampler(
                labels, classes_per_batch=56, samples_per_class=2, classes_with_replacement=True
            )
        )
    )
    assert len(batch) == 112


def test_the_reproduce_protocols_take_the_seeds_samplers():
    for name in ("agrouping", "agrouping-googlenet", "agrouping-sec42"):
        sampling = load_protocol(name).sampling
        assert sampling.images_with_replacement and not sampling.classes_with_replacement
    for cell in load_grid("diml-table1").cells:
        assert (
            cell.protocol.sampling.images_with_replacement
            and cell.protocol.sampling.classes_with_replacement
        )
    roth = load_protocol("roth2020").sampling
    assert not roth.images_with_replacement and not roth.classes_with_replacement


# ------------------------------------------------------------------ 3. query weight decay


def test_sec42_takes_the_codes_query_weight_decay():
    """DGML-master@7834411 configs/cub200.yaml:15-17: decay and key_val_decay 0.003, que_decay 0.001."""
    protocol = load_protocol("agrouping-sec42")
    assert protocol.optimizer.weight_decay == pytest.approx(3e-3)
    assert protocol.methods["agrouping"]["query_weight_decay"] == pytest.approx(1e-3)


# ------------------------------------------------------- 4. Roth et al.'s loss arithmetic


def _batch(seed=0, classes=20, per_class=2, dim=32, spread=0.9):
    """Unit embeddings around class centres, so that some anchors keep no hard pair."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    centres = torch.randn(classes, dim, generator=g)
    emb = F.normalize(centres[labels] + spread * torch.randn(len(labels), dim, generator=g), dim=1)
    return emb, labels


def _triplets(labels, seed=0):
    """One triplet per anchor: its class mate, a random other-class item."""
    g = torch.Generator().manual_seed(seed)
    a, p, n = [], [], []
    for i in range(len(labels)):
        mates = [j for j in range(len(labels)) if labels[j] == labels[i] and j != i]
        others = [j for j in range(len(labels)) if labels[j] != labels[i]]
        a.append(i)
        p.append(mates[0])
        n.append(others[int(torch.randint(len(others), (1,), generator=g))])
    return torch.tensor(a), torch.tensor(p), torch.tensor(n)


def test_roth_margin_divides_by_the_triplets_with_an_active_term():
    """wl-zhao/DIML@c15dbea criteria/margin.py l. 59-67 (beta = 1.2 per class, margin 0.2)."""
    emb, labels = _batch()
    a, p, n = _triplets(labels)
    d_ap, d_an = (emb[a] - emb[p]).norm(dim=1), (emb[a] - emb[n]).norm(dim=1)
    pos, neg = F.relu(d_ap - 1.2 + 0.2), F.relu(1.2 - d_an + 0.2)
    expected = (pos + neg).sum() / ((pos > 0) | (neg > 0)).sum()
    args = {"margin": 0.2, "beta": 1.2}
    roth = create_loss("margin", {**args, "reduction": "roth"}, num_classes=20, embedding_size=32)
    pml = create_loss("margin", args, num_classes=20, embedding_size=32)
    assert float(roth(emb, labels, (a, p, n))) == pytest.approx(float(expected), rel=1e-5)
    assert float(pml(emb, labels, (a, p, n))) < 0.9 * float(expected)  # PML: / active terms


def test_roth_contrastive_averages_over_all_sampled_triplets():
    """wl-zhao/DIML@c15dbea criteria/contrastive.py l. 34-37 (margins 0 and 1)."""
    emb, labels = _batch(dim=3)
    a, p, n = _triplets(labels)
    assert (
        0 < int(((emb[a] - emb[n]).norm(dim=1) > 1).sum()) < len(a)
    )  # some negative terms are zero
    expected = (emb[a] - emb[p]).norm(dim=1).mean() + F.relu(
        1 - (emb[a] - emb[n]).norm(dim=1)
    ).mean()
    args = {"pos_margin": 0.0, "neg_margin": 1.0}
    roth = create_loss(
        "contrastive", {**args, "reduction": "roth"}, num_classes=20, embedding_size=3
    )
    pml = create_loss("contrastive", args, num_classes=20, embedding_size=3)
    assert float(roth(emb, labels, (a, p, n))) == pytest.approx(float(expected), rel=1e-5)
    assert float(pml(emb, labels, (a, p, n))) != pytest.approx(float(expected), rel=1e-2)


def _roth_multi_similarity(emb, labels, alpha=2.0, beta=40.0, margin=0.1, thresh=0.5) -> float:
    """criteria/multisimilarity.py l. 28-56 of wl-zhao/DIML@c15dbea, written out per anchor."""
    sim = emb @ emb.t()
    losses = []
    for i in range(len(emb)):
        pos_mask = labels == labels[i]
        pos_mask[i] = False
        pos, neg = sim[i][pos_mask], sim[i][labels != labels[i]]
        hard_neg, hard_pos = neg[neg + margin > pos.min()], pos[pos - margin < neg.max()]
        if not len(hard_neg) or not len(hard_pos):
            continue
        losses.append(
            torch.log(1 + torch.exp(-alpha * (hard_pos - thresh)).sum()) / alpha
            + torch.log(1 + torch.exp(beta * (hard_neg - thresh)).sum()) / beta
        )
    return float(torch.stack(losses).mean()) if losses else 0.0


def test_roth_multi_similarity_averages_over_the_anchors_that_kept_both_kinds():
    emb, labels = _batch(spread=0.6)
    miner = create_miner("multi_similarity", {"epsilon": 0.1})
    pairs = miner(emb, labels).compact()  # PML's index lists (a1, p, a2, n)
    kept = set(pairs[0].tolist()) & set(pairs[2].tolist())
    assert 0 < len(kept) < len(emb)  # the batch has anchors the code skips
    args = {"alpha": 2.0, "beta": 40.0, "base": 0.5}
    roth = create_loss(
        "multi_similarity", {**args, "reduction": "roth"}, num_classes=20, embedding_size=32
    )
    pml = create_loss("multi_similarity", args, num_classes=20, embedding_size=32)
    expected = _roth_multi_similarity(emb, labels)
    assert float(roth(emb, labels, pairs)) == pytest.approx(expected, rel=1e-5)
    assert float(pml(emb, labels, pairs)) != pytest.approx(expected, rel=1e-2)


def test_roth_multi_similarity_is_zero_with_the_graph_when_no_anchor_keeps_both():
    emb, labels = _batch()
    emb.requires_grad_(True)
    roth = create_loss("multi_similarity", {"reduction": "roth"}, num_classes=20, embedding_size=32)
    only_positives = (
        torch.tensor([0, 2]),
        torch.tensor([1, 3]),
        torch.tensor([], dtype=torch.long),
        torch.tensor([], dtype=torch.long),
    )
    loss = roth(emb, labels, only_positives)
    assert float(loss) == 0.0
    loss.backward()
    assert emb.grad is not None


def test_roth_margin_refuses_the_beta_regulariser():
    with pytest.raises(
        HarnessError, match="reduction 'roth' follows Roth et al.'s criteria/margin.py"
    ):
        create_loss("margin", {"reduction": "roth", "nu": 0.1}, num_classes=5, embedding_size=8)


def test_diml_table1_trains_with_roth_arithmetic_and_roth2020_keeps_pmls():
    for cell in load_grid("diml-table1").cells:
        assert cell.loss_args["reduction"] == "roth", cell.label
    for loss in ("margin", "contrastive", "multi_similarity"):
        assert load_protocol("roth2020").loss_args(loss).get("reduction", "pml") == "pml"
    assert {"loss_reduction", "sampler_replacement"} <= set(load_protocol("roth2020").deviations)


# ------------------------------------------------------------------------ fingerprints


def test_new_keys_at_their_defaults_leave_the_canonical_form_and_fingerprint_alone():
    from harness.config.protocol import FINGERPRINT_OMITTED_AT_DEFAULT, Protocol, apply_overrides

    for dotted, default in FINGERPRINT_OMITTED_AT_DEFAULT.items():
        section, key = dotted.split(".")
        assert getattr(getattr(Protocol, section), key) == default, dotted
    protocol = load_protocol("roth2020")
    before = fingerprint(protocol, "digest")
    assert "images_with_replacement" not in protocol.to_dict()["sampling"]
    changed, deviations = apply_overrides(protocol, {"sampling.images_with_replacement": True})
    assert deviations and changed.to_dict()["sampling"]["images_with_replacement"] is True
    assert fingerprint(changed, "digest") != before
    same, _ = apply_overrides(protocol, {"sampling.images_with_replacement": False})
    assert fingerprint(same, "digest") == before
