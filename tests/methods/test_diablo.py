"""DIABLO (Jacob et al. 2020): golden values for Eqs. 1-13 on small tensors, the backbone
wiring of Sec. 4.1, and the pretrained copy phi (backbone weights, backbone learning rate)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from harness.base.errors import HarnessError
from harness.components.backbones import create_backbone
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol
from harness.engine.run.model import EmbeddingModel, build_optimizer
from harness.methods import METHODS, create_method
from harness.methods.diablo import (
    DiabloHead,
    attended_energy,
    dimension_wise_attention,
    feature_wise_attention,
    merge,
)
from tests.methods.test_conformance import build, images, toy_backbone

EMB = 32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ Eqs. 5-13, by hand


def test_feature_wise_attention_is_eq_7_by_hand():
    """Eqs. 5 and 7: A^(n)_ij = exp(alpha s_n) / sum_l exp(alpha s_l), s = cosine (Eq. 5)."""
    phi = torch.randn(2, 5, 3, 4, generator=gen(0))
    dictionary = torch.randn(3, 5, generator=gen(1))
    alpha = 4.0
    got = feature_wise_attention(phi, dictionary, alpha)
    assert got.shape == (2, 3, 1, 3, 4)
    for b in range(2):
        for i in range(3):
            for j in range(4):
                f = phi[b, :, i, j]
                s = [float(f @ d / (f.norm() * d.norm())) for d in dictionary]
                z = sum(math.exp(alpha * v) for v in s)
                for n in range(3):
                    assert float(got[b, n, 0, i, j]) == pytest.approx(
                        math.exp(alpha * s[n]) / z, rel=1e-5
                    )
    # Each location's weights sum to 1 over the N entries.
    torch.testing.assert_close(got.sum(1), torch.ones(2, 1, 3, 4))


def test_feature_wise_attention_tends_to_the_one_hot_of_eq_6():
    """Eq. 7 relaxes Eq. 6: as alpha grows the weights become the arg-max's one-hot."""
    phi = torch.randn(1, 6, 2, 2, generator=gen(2))
    dictionary = torch.randn(4, 6, generator=gen(3))
    hard = feature_wise_attention(phi, dictionary, 1e4)[:, :, 0]
    cos = torch.einsum("bmhw,nm->bnhw", F.normalize(phi, dim=1), F.normalize(dictionary, dim=-1))
    torch.testing.assert_close(hard, F.one_hot(cos.argmax(1), 4).permute(0, 3, 1, 2).float())


def test_dimension_wise_attention_is_eq_11_by_hand():
    """Eqs. 10-11: one direction per (entry n, channel k); soft-max over n for each k."""
    phi = torch.randn(1, 5, 2, 2, generator=gen(4))
    directions = torch.randn(3, 4, 5, generator=gen(5))  # N x c x m
    alpha = 3.0
    got = dimension_wise_attention(phi, directions, alpha)
    assert got.shape == (1, 3, 4, 2, 2)
    f = phi[0, :, 1, 0]
    for k in range(4):
        s = [float(f @ directions[n, k] / (f.norm() * directions[n, k].norm())) for n in range(3)]
        z = sum(math.exp(alpha * v) for v in s)
        for n in range(3):
            assert float(got[0, n, k, 1, 0]) == pytest.approx(math.exp(alpha * s[n]) / z, rel=1e-5)
    torch.testing.assert_close(got.sum(1), torch.ones(1, 4, 2, 2))


@pytest.mark.parametrize("select", ["feature", "dimension"])
def test_merged_branches_sum_back_to_the_input_map(select):
    """Eqs. 8-9 / 12-13: H^(n) = A^(n) (x) F; the weights sum to 1 over n, so sum_n H^(n) = F."""
    features = torch.randn(2, 4, 3, 3, generator=gen(6))
    phi = torch.randn(2, 5, 3, 3, generator=gen(7))
    if select == "feature":
        attention = feature_wise_attention(phi, torch.randn(3, 5, generator=gen(8)), 5.0)
    else:
        attention = dimension_wise_attention(phi, torch.randn(3, 4, 5, generator=gen(8)), 5.0)
    merged = merge(features, attention)
    assert merged.shape == (2, 3, 4, 3, 3)
    torch.testing.assert_close(merged.sum(1), features)
    # Eq. 12 element by element; for feature-wise one weight serves every channel (Eq. 8).
    k = 2
    torch.testing.assert_close(
        merged[:, 1, k], attention[:, 1, 0 if select == "feature" else k] * features[:, k]
    )


def test_attended_energy_is_each_entrys_merged_feature_energy():
    features = torch.randn(2, 4, 3, 3, generator=gen(9))
    attention = dimension_wise_attention(
        torch.randn(2, 5, 3, 3, generator=gen(10)), torch.randn(3, 4, 5, generator=gen(11)), 2.0
    )
    energy = attended_energy(features, attention)
    # ||H^(n)_ij||^2 of Eq. 12's merged maps, entry by entry.
    torch.testing.assert_close(energy, merge(features, attention).pow(2).sum(2))
    # An entry that takes a location whole gets its whole energy; one that takes none, none.
    one_hot = torch.zeros_like(attention)
    one_hot[:, 0] = 1
    torch.testing.assert_close(attended_energy(features, one_hot)[:, 0], features.pow(2).sum(1))
    assert (attended_energy(features, one_hot)[:, 1:] == 0).all()


def test_attended_energy_puts_an_entrys_map_where_its_attention_meets_strong_features():
    """A hand-built case whose right map is known: features strong on one cell only and
    attention spread evenly. The energy map peaks on that cell; each entry's share of
    the energy (the map drawn before) is the same everywhere, a flat map."""
    features = torch.full((1, 4, 3, 3), 0.1)
    features[0, :, 1, 2] = 3.0
    attention = torch.full((1, 2, 4, 3, 3), 0.5)
    energy = attended_energy(features, attention)
    assert energy[0, 0].argmax() == 1 * 3 + 2
    assert energy[0, 0, 1, 2] / energy[0, 0].sum() > 0.9
    share = energy / features.pow(2).sum(1)[:, None]
    torch.testing.assert_close(share, torch.full_like(share, 0.25))


# ---------------------------------------------------------------- Eqs. 1-4, through a head


def test_pre_attention_with_uniform_attention_is_the_backbone():
    """Eqs. 3-4 with alpha -> 0 (every A^(n) = 1/N) and psi's input rescaled by N: every
    branch refines F itself, so each branch's pooled features are the backbone's own GAP."""
    model = build("diablo", entries=4, temperature=1e-9).eval()
    head = model.head
    x = images(3)
    with torch.no_grad():
        features = model.backbone(x)[0]
        full = model.backbone.run(features, start=head.input_point)
        out = model(x)
        expected = F.normalize(
            torch.einsum("bc,ncd->bnd", full.mean(dim=(2, 3)), head.branch_weight)
            + head.branch_bias,
            dim=-1,
        )
    torch.testing.assert_close(out.groups, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.embedding, expected.flatten(1) / 2)  # concatenation / sqrt(N)


def test_post_attention_runs_psi_once_and_weighs_its_output():
    """Eqs. 1-2: G = psi(F) once; H^(n) = A^(n) G; with uniform attention each branch pools G / N."""
    model = build("diablo", placement="post", entries=2, temperature=1e-9).eval()
    head = model.head
    calls = []
    head.backbone.body.stage4.register_forward_hook(
        lambda _m, inp, _o: calls.append(inp[0].shape[0])
    )
    x = images(4)
    with torch.no_grad():
        out = model(x)
        g = model.backbone.run(model.backbone(x)[0], start=head.input_point)
    assert calls[0] == x.shape[0]  # psi on the batch, not on N x batch
    expected = F.normalize(
        torch.einsum("bc,ncd->bnd", g.mean(dim=(2, 3)) / 2, head.branch_weight) + head.branch_bias,
        dim=-1,
    )
    torch.testing.assert_close(out.groups, expected, rtol=1e-4, atol=1e-5)


def test_pre_attention_runs_psi_once_per_entry():
    model = build("diablo", entries=8).eval()
    calls = []
    model.head.backbone.body.stage4.register_forward_hook(
        lambda _m, inp, _o: calls.append(inp[0].shape[0])
    )
    with torch.no_grad():
        model(images())
    assert calls == [8 * images().shape[0]]


@pytest.mark.parametrize("selection", ["feature", "dimension"])
@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("entries", [2, 8, 16])
def test_every_combination_embeds_and_trains(selection, placement, entries):
    model = build("diablo", selection=selection, placement=placement, entries=entries).train()
    out = model(images())
    assert out.embedding.shape == (8, EMB) and out.groups.shape == (8, entries, EMB // entries)
    torch.testing.assert_close(out.groups.norm(dim=-1), torch.ones(8, entries))
    assert out.attention.shape[:2] == (8, entries)
    shape = (entries, model.backbone.channels["s32"]) if selection == "feature" else None
    if shape:
        assert model.head.dictionary.shape[0] == entries and model.head.dictionary.dim() == 2
    else:
        assert model.head.dictionary.dim() == 3
    out.embedding.sum().backward()
    assert model.head.dictionary.grad is not None and model.head.dictionary.grad.abs().sum() > 0


# ---------------------------------------------------------------- phi: a pretrained copy


def test_phi_starts_with_the_backbone_weights_and_trains_at_the_backbone_rate():
    model = build("diablo")
    head, backbone = model.head, model.backbone
    phi = head.pretrained["phi"]
    source = backbone.body.stage3  # the s16 stage (pre-attention: phi = a copy of it)
    for (name, a), (_, b) in zip(
        phi[0].state_dict().items(), source.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=name)
    # A copy, not the same tensors: training phi leaves the backbone's stage alone.
    assert all(p.data_ptr() != q.data_ptr() for p in phi.parameters() for q in source.parameters())
    # BatchNorm of the copy follows the backbone's freeze_bn.
    model.train()
    assert not any(m.training for m in phi.modules() if isinstance(m, torch.nn.BatchNorm2d))
    protocol, _ = apply_overrides(
        load_protocol("smoke"), {"optimizer.lr_backbone": 1e-5, "optimizer.lr_head": 1e-3}
    )
    groups = build_optimizer(protocol, model, torch.nn.Module()).param_groups
    by_param = {id(p): g for g in groups for p in g["params"]}
    assert all(
        by_param[id(p)]["lr"] == 1e-5 and by_param[id(p)]["name"] == "backbone"
        for p in phi.parameters()
    )
    assert by_param[id(head.dictionary)]["lr"] == 1e-3


# ---------------------------------------------------------------- Sec. 4.1 wiring


@pytest.mark.parametrize(
    "placement, point, phi_first, phi_last, width",
    [
        ("pre", "pool3", "inception4a", "inception4e", 832),
        ("post", "pool4", "inception5a", "inception5b", 1024),
    ],
)
def test_googlenet_wiring_is_section_4_1(placement, point, phi_first, phi_last, width):
    """Pre: F after maxpool3 (14 x 14 x 480), phi = a copy of 4a-4e (m = 832), psi = 4a-5b.
    Post: F after maxpool4, phi = a copy of 5a-5b, psi = the backbone's 5a-5b."""
    torch.manual_seed(0)
    backbone = create_backbone("googlenet", pretrained=False)
    head = create_method(
        "diablo", channels=backbone.channels, embedding_size=512, placement=placement
    )
    head.setup(backbone)
    backbone.set_outputs(head.stages)
    assert head.stages == (point,) and backbone.out_stages == (point,)
    phi = head.pretrained["phi"]
    names = [n for n, _ in backbone.body.named_children()]
    copied = [type(m).__name__ for m in phi]
    assert copied == [
        type(getattr(backbone.body, n)).__name__
        for n in names[names.index(phi_first) : names.index(phi_last) + 1]
        if n != "maxpool4"
    ]
    m = head.dictionary.shape[-1]
    assert m == width
    c = 480 if placement == "pre" else 1024
    assert tuple(head.dictionary.shape) == (8, c, m)
    model = EmbeddingModel(backbone, head).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 224, 224))
    assert out.embedding.shape == (2, 512) and out.attention.shape == (
        2,
        8,
        14 if placement == "pre" else 7,
        14 if placement == "pre" else 7,
    )


def test_resnet_wiring_is_the_harness_design():
    """ResNet (harness's own mapping): pre F = layer2's output, phi = a copy of layer3;
    post F = layer3's output, phi = a copy of layer4."""
    backbone = create_backbone("resnet18", pretrained=False)
    for placement, point, stage in (("pre", "s8", "s16"), ("post", "s16", "s32")):
        head = create_method(
            "diablo", channels=backbone.channels, embedding_size=64, placement=placement, entries=4
        )
        head.setup(backbone)
        assert head.stages == (point,)
        assert head.dictionary.shape[-1] == backbone.channels[stage]


# ---------------------------------------------------------------- options, registry


def test_bad_options_are_one_clear_error():
    for options, match in (
        ({"entries": 3}, "positive divisor of the embedding size 32"),
        ({"selection": "channel"}, "selection must be one of"),
        ({"placement": "middle"}, "placement must be one of"),
        ({"temperature": 0.0}, "temperature"),
    ):
        with pytest.raises(HarnessError, match=match):
            create_method("diablo", channels=toy_backbone().channels, embedding_size=EMB, **options)


def test_registry_and_paper_metadata():
    assert METHODS.get("diablo").cls is DiabloHead
    assert METHODS.get("diablo_n16").preset == {"entries": 16}
    assert not METHODS.get("diablo").ablation and METHODS.get("diablo_feature_post").ablation
    paper = DiabloHead.paper
    assert paper.year == 2020 and "DIABLO" in paper.title and paper.tables == ("1", "2", "3", "4")
