"""SAM (Zheng et al., "Visual Similarity Attention"): golden values for the weight vectors
(Sec. 3.1, 3.1.1), Eq. 1 and its closed form, the soft mask and L_sm (Sec. 3.2, Eq. 2);
the tuples of the masked pass are the metric loss's mined tuples; L_sm's gradient reaches
the attention; attention is float32 under autocast. CPU, toy backbone."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning.miners import DistanceWeightedMiner
from torch import nn

from harness.base.errors import HarnessError
from harness.components.losses import MetricLoss, create_loss
from harness.methods import METHODS, TrainingBatch, check_method_options, list_methods
from harness.methods.base import MethodEntry
from harness.methods.sam import (
    SAMHead,
    closed_form_attention,
    eq1_attention,
    normalize_attention,
    pair_weights,
    quadruplet_weights,
    select_tuples,
    similarity_mining_loss,
    soft_mask,
    triplet_weights,
)
from harness.methods.sam_tuples import select_fixed_tuples
from harness.reports.explanations import write_tuple_figures
from tests.methods.sam_references import random_mined_batch, reference_select
from tests.methods.test_conformance import BATCH, EMB, IMAGE, build, images

LABELS = torch.arange(BATCH) // 2  # 4 classes x 2


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ registry


def test_registered_names_and_default_form():
    """``sam`` is the triplet form (Sec. 3, Sec. 4.1, Table 2); the other two are Table 1 ablations."""
    assert METHODS.get("sam").options()["form"] == "triplet"
    assert METHODS.get("sam_siamese").options()["form"] == "siamese"
    assert METHODS.get("sam_quadruplet").options()["form"] == "quadruplet"
    assert "sam" in list_methods(ablations=False)
    assert not {"sam_siamese", "sam_quadruplet"} & set(list_methods(ablations=False))
    assert SAMHead.paper.tables == ("1", "2")


@pytest.mark.parametrize(
    "option, value",
    [
        ("form", "pairs"),
        ("stage", "s4"),
        ("alpha", 0.0),
        ("beta", 1.5),
        ("gamma", -1.0),
        ("normalize", "sum"),
        ("mining", "easy"),
    ],
)
def test_bad_options_are_one_clear_error(option, value):
    with pytest.raises(HarnessError, match=f"method 'sam'.*{option}"):
        check_method_options("sam", {option: value}, embedding_size=EMB)


# ------------------------------------------------------------------ Sec. 3.1: weights, by hand


def test_weight_vectors_by_hand():
    """w^p = 1 - |f_a - f_p| (the paper's example: 0.80 vs 0.78 -> 0.98), w^n = |f_a - f_n|,
    w = w^p * w^n; Siamese: one of the two by the pair's label; quadruplet: the product of three."""
    f_a = torch.tensor([0.80, 0.60, 0.00])
    f_p = torch.tensor([0.78, 0.62, 0.10])
    f_n = torch.tensor([0.00, 0.60, 0.80])
    f_n2 = torch.tensor([0.60, 0.00, 0.80])
    torch.testing.assert_close(
        triplet_weights(f_a, f_p, f_n), torch.tensor([0.98 * 0.8, 0.0, 0.9 * 0.8])
    )
    torch.testing.assert_close(pair_weights(f_a, f_p, True), torch.tensor([0.98, 0.98, 0.9]))
    torch.testing.assert_close(pair_weights(f_a, f_n, False), torch.tensor([0.8, 0.0, 0.8]))
    both = pair_weights(
        torch.stack([f_a, f_a]), torch.stack([f_p, f_n]), torch.tensor([True, False])
    )
    torch.testing.assert_close(both, torch.tensor([[0.98, 0.98, 0.9], [0.8, 0.0, 0.8]]))
    torch.testing.assert_close(
        quadruplet_weights(f_a, f_p, f_n, f_n2),
        torch.tensor([0.98 * 0.8 * 0.2, 0.0, 0.9 * 0.8 * 0.8]),
    )


# ------------------------------------------------------------------ Eq. 1


def _tiny_map():
    """2 channels on 2 x 2: GAP = (3, 4), so with W = I, b = 0: e = (3, 4), |e| = 5, f = (0.6, 0.8)."""
    a0 = torch.tensor([[4.0, 2.0], [3.0, 3.0]])
    a1 = torch.tensor([[0.0, 8.0], [2.0, 6.0]])
    return torch.stack([a0, a1])[None]


def test_eq1_on_a_tiny_map_by_hand():
    """w = (1, 0): g = (w - (w.f) f) / |e| = ((1, 0) - 0.6 (0.6, 0.8)) / 5 = (0.128, -0.096);
    alpha = W^T g / (h w) = (0.032, -0.024); M = ReLU(0.032 A_0 - 0.024 A_1)."""
    maps = _tiny_map()
    e = torch.tensor([[3.0, 4.0]])
    f = e / 5
    w = torch.tensor([[1.0, 0.0]])
    expected = torch.tensor([[[0.128, 0.0], [0.048, 0.0]]])
    torch.testing.assert_close(closed_form_attention(maps, e, f, w, torch.eye(2)), expected)
    grads = torch.tensor([0.032, -0.024])[None, :, None, None].expand(1, 2, 2, 2)
    torch.testing.assert_close(eq1_attention(maps, grads), expected)
    # The same through the definition: s = w . f(A), alpha_k = GAP(ds/dA_k).
    a = maps.clone().requires_grad_()
    s = (w * F.normalize(a.mean(dim=(2, 3)), dim=-1)).sum()
    torch.testing.assert_close(eq1_attention(maps, torch.autograd.grad(s, a)[0]), expected)


def test_closed_form_equals_autograd_on_random_maps():
    """The closed form (no double backward) is Eq. 1 with autograd's ds/dA, to 1e-5."""
    maps = torch.randn(5, 7, 3, 4, generator=gen(0)).abs().requires_grad_()
    weight, bias = torch.randn(6, 7, generator=gen(1)), torch.randn(6, generator=gen(2))
    e = F.linear(maps.mean(dim=(2, 3)), weight, bias)
    f = F.normalize(e, dim=-1)
    w = torch.rand(5, 6, generator=gen(3))
    s = (w * f).sum()  # one score per row; rows are independent
    (grads,) = torch.autograd.grad(s, maps, retain_graph=True)
    # The gradient is constant over space (GAP -> Linear -> L2).
    torch.testing.assert_close(grads, grads[..., :1, :1].expand_as(grads))
    torch.testing.assert_close(
        closed_form_attention(maps, e, f, w, weight),
        eq1_attention(maps, grads),
        rtol=1e-5,
        atol=1e-5,
    )


def test_closed_form_equals_autograd_on_the_model():
    """The head's attention on the last map: closed form vs autograd (``closed_form=False``)."""
    model = build("sam").eval()
    head = model.head
    with torch.no_grad():
        fmap = model(images()).extras["map"]
    a = fmap.clone().requires_grad_()
    e, f = head.features32(a)
    w = pair_weights(f, f.roll(1, 0), True).detach()
    closed = head.attention(a, e, f, w)
    auto = head.attention(a, e, f, w, closed_form=False, create_graph=False)
    assert closed.shape == (BATCH, *fmap.shape[-2:]) and closed.abs().sum() > 0
    torch.testing.assert_close(closed, auto, rtol=1e-5, atol=1e-5)


def test_earlier_stage_attention_is_per_image():
    """On ``s16`` Eq. 1 runs autograd over a batch of rows: each row's map equals the one from
    that image alone (BatchNorm frozen, rows independent), and the map varies over space."""
    model = build("sam", stage="s16").train()
    head = model.head
    assert head.stages == ("s16",) and model.backbone.out_stages == ("s16",)
    with torch.no_grad():
        fmap = model(images()).extras["map"]
    assert fmap.shape[1] == 32  # the toy's s16 width
    a = fmap.clone().requires_grad_()
    e, f = head.features32(a)
    w = torch.rand(BATCH, EMB, generator=gen(4))
    batched = head.attention(a, e, f, w, create_graph=False)
    for i in (0, 5):
        one = fmap[i : i + 1].clone().requires_grad_()
        e1, f1 = head.features32(one)
        s = (w[i : i + 1] * f1).sum()
        torch.testing.assert_close(
            batched[i : i + 1],
            eq1_attention(one, torch.autograd.grad(s, one)[0]),
            rtol=1e-5,
            atol=1e-6,
        )


# ------------------------------------------------------------------ Sec. 3.2: masks and L_sm


def test_soft_mask_and_normalisation_by_hand():
    """1 - sigmoid(alpha (M - beta)): 1 - sigmoid(-5) = 0.99331 at 0, 0.5 at beta, 0.00669 at 1."""
    m = torch.tensor([0.0, 0.5, 1.0])
    torch.testing.assert_close(
        soft_mask(m, 10.0, 0.5), torch.tensor([0.993307, 0.5, 0.006693]), atol=1e-6, rtol=0
    )
    maps = torch.tensor([[[[0.0, 2.0], [1.0, 4.0]]], [[[0.0, 0.0], [0.0, 0.0]]]])
    torch.testing.assert_close(
        normalize_attention(maps, "max")[0, 0], torch.tensor([[0.0, 0.5], [0.25, 1.0]])
    )
    torch.testing.assert_close(normalize_attention(maps, "max")[1], torch.zeros(1, 2, 2))
    shifted = maps + 2
    torch.testing.assert_close(
        normalize_attention(shifted, "minmax")[0, 0], torch.tensor([[0.0, 0.5], [0.25, 1.0]])
    )


def test_head_masks_upsample_then_normalise():
    head = build("sam", alpha=4.0, beta=0.25).head
    att = torch.tensor([[[0.0, 2.0], [2.0, 2.0]]])
    masks = head.masks(att, (4, 4))
    assert masks.shape == (1, 1, 4, 4)
    up = F.interpolate(att[:, None], size=(4, 4), mode="bilinear", align_corners=False)
    torch.testing.assert_close(masks, 1 - torch.sigmoid(4.0 * (up / up.amax() - 0.25)))
    assert float(masks[0, 0, 0, 0]) > float(masks[0, 0, 3, 3])  # low attention is kept


def test_similarity_mining_loss_by_hand():
    """Eq. 2: | ||f*a - f*p|| - ||f*a - f*n|| |; Siamese: -||f*1 - f*2||; quadruplet: Eq. 2 on
    (a, p, n1) plus on (a, p, n2). Averaged over tuples."""
    a, p, n, n2 = (torch.tensor(v) for v in ([1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 0.0]))
    r2 = math.sqrt(2)
    tri = torch.stack([torch.stack([a, p, n]), torch.stack([a, a, n])])
    assert float(similarity_mining_loss(tri, "triplet")) == pytest.approx(
        ((2 - r2) + 2) / 2, abs=1e-5
    )
    assert float(similarity_mining_loss(torch.stack([a, p])[None], "siamese")) == pytest.approx(
        -r2, abs=1e-5
    )
    quad = torch.stack([a, p, n, n2])[None]
    assert float(similarity_mining_loss(quad, "quadruplet")) == pytest.approx(
        (2 - r2) + r2, abs=1e-5
    )
    # Finite gradient where two masked embeddings coincide.
    same = torch.stack([a, a, n])[None].requires_grad_()
    similarity_mining_loss(same, "triplet").backward()
    assert torch.isfinite(same.grad).all()


# ------------------------------------------------------------------ tuples


def test_select_tuples_takes_mined_tuples_without_sharing_images():
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    mined = (torch.tensor([0, 1, 2, 3]), torch.tensor([1, 0, 3, 2]), torch.tensor([2, 4, 0, 5]))
    torch.manual_seed(0)
    got = select_tuples(mined, labels, "triplet").tolist()
    rows = [list(t) for t in zip(*(m.tolist() for m in mined), strict=True)]
    assert got and all(t in rows for t in got)
    flat = [i for t in got for i in t]
    assert len(flat) == len(set(flat))
    # Hardest first: d(a, p) - d(a, n) largest.
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.0, -1.0], [-1.0, 0.0], [0.0, 1.0]])
    hard = select_tuples(mined, labels, "triplet", emb, "hardest").tolist()
    d = torch.cdist(emb, emb)
    hardness = {tuple(t): float(d[t[0], t[1]] - d[t[0], t[2]]) for t in rows}
    assert hard[0] == list(max(hardness, key=hardness.get))
    # Siamese: positive pairs of the mined triplets; quadruplet: + an n2 of a third class.
    pairs = select_tuples(mined, labels, "siamese").tolist()
    assert pairs and all(labels[i] == labels[j] for i, j in pairs)
    quads = select_tuples(mined, labels, "quadruplet").tolist()
    for a, p, n1, n2 in quads:
        assert [a, p, n1] in rows and labels[n2] not in (labels[a], labels[n1])
    assert select_tuples(None, torch.tensor([0, 1, 2]), "triplet").shape == (0, 3)  # no positives


@pytest.mark.parametrize("form", ["triplet", "siamese", "quadruplet"])
@pytest.mark.parametrize("mining", ["random", "hardest"])
def test_select_tuples_equals_the_direct_greedy_selection(form, mining):
    """The selection from one packed transfer chooses exactly the tuples of the direct
    transcription, and draws the same random numbers from torch's global generator."""
    chosen = 0
    for seed in range(12):
        indices, labels, emb = random_mined_batch(seed)
        torch.manual_seed(seed)
        ref = reference_select(indices, labels, form, emb, mining)
        after_ref = torch.rand(3)
        torch.manual_seed(seed)
        got = select_tuples(indices, labels, form, emb, mining)
        assert torch.equal(got, ref), (seed, got.tolist(), ref.tolist())
        assert torch.equal(torch.rand(3), after_ref)  # the generator advanced alike
        chosen += len(got)
    assert chosen > 12


class SpyMiner(DistanceWeightedMiner):
    def __init__(self):
        super().__init__(cutoff=0.5, nonzero_loss_cutoff=1.4)
        self.mined = []

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        self.mined.append(out)
        return out


class SpyLoss(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.indices = inner, []

    def forward(self, embeddings, labels, indices=None):
        self.indices.append(indices)
        return self.inner(embeddings, labels, indices)


class SpyModel(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.inputs = model, []

    def forward(self, x):
        self.inputs.append(x.detach().clone())
        return self.model(x)


@pytest.mark.parametrize("selection", ["host", "fixed"])
@pytest.mark.parametrize("name", ["sam", "sam_siamese", "sam_quadruplet"])
def test_masked_pass_uses_the_tuples_the_metric_loss_mined(name, selection):
    """The miner runs once; the metric loss gets its very tuples, and the masked pass embeds
    exactly the images of the tuples selected from them (replayed from the same state of
    torch's generator; in the fixed shape, those of every slot, kept or not), each
    multiplied by a mask in [0, 1]."""
    model = build(name, selection=selection).train()
    head = model.head
    miner = SpyMiner()
    loss = SpyLoss(create_loss("triplet", num_classes=4, embedding_size=EMB))
    metric_loss = MetricLoss(loss, miner)
    spy_model = SpyModel(model)
    x = images()
    out = model(x)
    torch.manual_seed(0)
    terms = head.loss_terms(out, TrainingBatch(LABELS, metric_loss, x, spy_model))
    assert set(terms) == {"metric", "similarity_mining"}
    assert len(miner.mined) == 1 and len(loss.indices) == 1
    mined = miner.mined[0]
    assert loss.indices[0] is mined
    torch.manual_seed(0)  # the miner's draws, then the selection's, as in the step
    again = SpyMiner()(out.embedding.float(), LABELS)
    assert all(torch.equal(a, b) for a, b in zip(again, mined, strict=True))
    f = out.embedding
    slots = (
        select_tuples(mined, LABELS, head.form, f, head.mining, selection)
        if selection == "host"
        else select_fixed_tuples(mined, LABELS, head.form, f, head.mining)
    )
    tuples = slots if selection == "host" else slots[0][slots[1]]
    k = {"sam": 3, "sam_siamese": 2, "sam_quadruplet": 4}[name]
    assert tuples.shape[1] == k and len(tuples) > 0
    triplets = {
        tuple(t) for t in torch.stack(mined, 1).tolist()
    }  # the distance-weighted miner: triplets
    for t in tuples.tolist():
        assert (
            tuple(t[:3]) in triplets if k >= 3 else (t[0], t[1]) in {(a, p) for a, p, _ in triplets}
        )
    flat = tuples.flatten()
    assert len(set(flat.tolist())) == len(flat)  # each image masked at most once
    assert len(spy_model.inputs) == 1
    masked = spy_model.inputs[0]
    embedded = flat if selection == "host" else slots[0].flatten()
    assert masked.shape == (len(embedded), 3, *IMAGE)
    ratio = masked / x[embedded]
    assert ratio.min() >= 0 and ratio.max() <= 1 and ratio.min() < 0.5  # soft masks erase something


def test_without_a_miner_all_tuples_are_candidates():
    model = build("sam").train()
    metric_loss = MetricLoss(create_loss("triplet", num_classes=4, embedding_size=EMB), None)
    spy = SpyModel(model)
    x = images()
    terms = model.head.loss_terms(model(x), TrainingBatch(LABELS, metric_loss, x, spy))
    assert len(spy.inputs) == 1 and len(spy.inputs[0]) == 6  # two disjoint triplets fit in 8 images
    assert torch.isfinite(terms["similarity_mining"])


# ------------------------------------------------------------------ gradient through M


def _sm_term(model, x, **_):
    metric_loss = MetricLoss(create_loss("triplet", num_classes=4, embedding_size=EMB), None)
    out = model(x)
    torch.manual_seed(0)
    terms = model.head.loss_terms(out, TrainingBatch(LABELS, metric_loss, x, model))
    return out, terms["similarity_mining"]


class DetachedMasksHead(SAMHead):
    """SAM whose masks take a detached attention: M carries no gradient (test only)."""

    def masks(self, attention, size):
        return super().masks(attention.detach(), size)


@pytest.mark.parametrize("stage", ["s32", "s16"])
def test_similarity_mining_gradient_flows_through_the_attention(stage):
    """The first pass's map enters L_sm only through M (the masks): its gradient is non-zero,
    and zero once M is detached; the head's weights get a different gradient without it."""
    model = build("sam", stage=stage).train()
    x = images()
    out, l_sm = _sm_term(model, x)
    fmap = out.extras["map"]
    grad_map, grad_w = torch.autograd.grad(l_sm, [fmap, model.head.project.weight])
    assert grad_map.abs().sum() > 0

    name = "sam-detached-masks"
    with METHODS.temporarily(name, MethodEntry(name, DetachedMasksHead, METHODS.get("sam").preset)):
        detached = build(name, stage=stage).train()
    detached.load_state_dict(model.state_dict())  # the same weights
    out, l_sm = _sm_term(detached, x)
    grad_map_d, grad_w_d = torch.autograd.grad(
        l_sm, [out.extras["map"], detached.head.project.weight], allow_unused=True
    )
    assert grad_map_d is None or grad_map_d.abs().sum() == 0
    assert not torch.allclose(grad_w, grad_w_d)


def test_detach_weights_changes_the_gradient_only_through_w():
    x = images()
    grads = {}
    for detach in (False, True):
        model = build("sam", detach_weights=detach).train()
        _, l_sm = _sm_term(model, x)
        grads[detach] = torch.autograd.grad(l_sm, model.head.project.weight)[0]
    assert not torch.allclose(grads[False], grads[True])


# ------------------------------------------------------------------ autocast


@pytest.mark.parametrize("stage", ["s32", "s16"])
def test_attention_is_float32_under_autocast(stage):
    """Under CPU bfloat16 autocast the attention (and w) equal the float32 computation from
    the same (bfloat16) map: autocast is disabled around Eq. 1."""
    model = build("sam", stage=stage).eval()
    with torch.no_grad():
        fmap = model(images()).extras["map"].to(torch.bfloat16)
    rows = torch.tensor([0, 1, 2, 3, 4, 6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m_amp, w_amp = model.head.tuple_attention(fmap[rows], create_graph=False)
    m32, w32 = model.head.tuple_attention(fmap[rows].float(), create_graph=False)
    assert m_amp.dtype == torch.float32 and w_amp.dtype == torch.float32
    torch.testing.assert_close(m_amp, m32, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w_amp, w32, rtol=1e-6, atol=1e-7)


def test_loss_terms_under_autocast_are_finite():
    model = build("sam").train()
    metric_loss = MetricLoss(create_loss("triplet", num_classes=4, embedding_size=EMB), None)
    x = images()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        terms = model.head.loss_terms(out, TrainingBatch(LABELS, metric_loss, x, model))
    assert all(torch.isfinite(t) for t in terms.values())
    sum(terms.values()).backward()


# ------------------------------------------------------------------ explanation


@pytest.mark.parametrize("stage", ["s32", "s16"])
def test_explain_pairs_each_image_with_its_nearest_neighbour(stage):
    model = build("sam", stage=stage).eval()
    head = model.head
    x = images(1)
    with torch.inference_mode():
        out = model(x)
        maps = head.explain(x, out)
    assert maps.shape == (BATCH, 1, *IMAGE) and maps.min() >= 0 and maps.max() <= 1
    # Image 0's map is its attention with its nearest neighbour, by hand.
    fmap = out.extras["map"].clone()
    a = fmap.clone().requires_grad_()
    e, f = head.features32(a)
    sims = f.detach() @ f.detach().T
    sims.fill_diagonal_(-2)
    j = int(sims[0].argmax())
    w = (1 - (f[0] - f[j]).abs()).detach()
    s = (w * f[0]).sum()
    m = eq1_attention(a[:1], torch.autograd.grad(s, a)[0][:1])
    expected = F.interpolate(m[:, None].detach(), size=IMAGE, mode="bilinear", align_corners=False)
    expected = (expected - expected.min()) / (expected.max() - expected.min())
    torch.testing.assert_close(maps[:1], expected, rtol=1e-4, atol=1e-5)


def test_pair_figure_is_written_from_local_embeddings(tmp_path):
    model = build("sam").eval()
    x = images(2)
    with torch.inference_mode():
        out = model(x)
    assert out.local is not None and out.local.shape[:2] == (BATCH, 9)
    pictures = [torch.rand(3, *IMAGE), torch.rand(3, *IMAGE)]
    written = write_tuple_figures(
        model.head, "pair", pictures, [out.select(0), out.select(1)], tmp_path / "fig"
    )
    assert [p.name for p in written] == ["pair.png"] and written[0].stat().st_size > 1000
    (figure,) = model.head.figures("pair", pictures, [out.select(0), out.select(1)]).figures
    q, g = model.head.local_pair_maps(out.select(0), out.select(1), image_size=IMAGE)
    assert [p.title for p in figure.panels[0]] == ["query", "gallery"]
    torch.testing.assert_close(figure.panels[0][1].heat, g, rtol=0, atol=0)
    # local rebuilds the embedding: e = mean_ij W A_ij + b.
    e = out.local.mean(1) + model.head.project.bias
    torch.testing.assert_close(F.normalize(e, dim=-1), out.embedding, rtol=1e-5, atol=1e-5)


def test_triplet_maps_are_eq_1_under_the_triplet_weight_and_fig_4_is_logged_with_them(tmp_path):
    """Fig. 4: each image's map is Eq. 1 with s = w . f_k, w = (1 - |f_a - f_p|) * |f_a - f_n|
    held constant, from autograd on the last map; the figure's data (.npz) holds them."""
    model = build("sam").eval()
    head = model.head
    x = images(3)
    with torch.inference_mode():
        out = model(x)
    anchor, positive, negative = 0, 1, 2
    maps = head.triplet_maps(
        out.select(anchor), out.select(positive), out.select(negative), image_size=IMAGE
    )
    a = out.extras["map"].clone().requires_grad_()
    _, f = head.features32(a)
    w = triplet_weights(f[anchor], f[positive], f[negative]).detach()
    for k, index in enumerate((anchor, positive, negative)):
        s = (w * f[index]).sum()
        (grad,) = torch.autograd.grad(s, a, retain_graph=True)
        expected = eq1_attention(a[index : index + 1].detach(), grad[index : index + 1])[0]
        torch.testing.assert_close(maps[k], expected, rtol=1e-4, atol=1e-6)
    pictures = [torch.rand(3, *IMAGE) for _ in range(3)]
    written = write_tuple_figures(
        head, "triplet", pictures, [out.select(i) for i in (anchor, positive, negative)], tmp_path
    )
    assert [p.name for p in written] == ["triplet.png", "triplet.npz"]
    with np.load(written[1]) as data:
        assert sorted(data.files) == ["anchor", "negative", "positive"]
        np.testing.assert_allclose(data["negative"], maps[2].numpy())
    q, g = head.local_pair_maps(out.select(0), out.select(1), image_size=IMAGE)
    assert q.shape == maps[0].shape and not torch.equal(q, maps[0])  # the pair weight is another w
