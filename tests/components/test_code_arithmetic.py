"""The released code's arithmetic, selected by named options, against the code's formulas
transcribed independently here (each citing the file and line it follows): AVSL
(zbr17/AVSL, with GeDML's margin loss), DIML (wl-zhao/DIML); and the protocol values
that select them. Seeded inputs, float64 where the harness allows it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.base.errors import HarnessError
from harness.components.losses import MetricLoss, create_loss
from harness.config.protocol_files import load_protocol
from harness.methods import TrainingBatch, create_method
from harness.methods.avsl import cam_certainty, normalized_edges
from harness.methods.base import HeadOutput
from tests.methods.test_conformance import EMB, build

CHANNELS = {"s8": 8, "s16": 16, "s32": 32}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def unit(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, generator=gen(seed), dtype=dtype), dim=-1)


# ------------------------------------------------------------------ AVSL 4a: margin loss


def gedml_margin_loss(metric_mat, labels, beta, alpha=0.2):
    """GeDML pair_based_loss/margin_loss.py ``compute_loss`` (zbr17/GeDML, lines 44-63) on
    every triplet (a, p, n): relu(alpha + d_ap - beta), relu(alpha - d_an + beta), the sum of
    the nonzero terms over their count. ``metric_mat`` is AVSL's collector matrix,
    sum |e1 - e2|^2 (zbr17/AVSL src/avsl/collectors/avsl_collector.py lines 231-234)."""
    pos_terms, neg_terms = [], []
    n = len(labels)
    for a, p, q in itertools.product(range(n), repeat=3):
        if a != p and labels[a] == labels[p] and labels[q] != labels[a]:
            b = beta[labels[a]]
            pos_terms.append(F.relu(alpha + metric_mat[a, p] - b))
            neg_terms.append(F.relu(alpha - metric_mat[a, q] + b))
    terms = torch.stack(pos_terms + neg_terms)
    nonzero = terms[terms > 0]
    return nonzero.sum() / len(nonzero)


@pytest.mark.parametrize("distance", ["squared", "euclidean"])
def test_avsl_level_margin_loss_runs_on_the_codes_squared_distance(distance):
    head = create_method(
        "avsl", channels=CHANNELS, embedding_size=EMB, distance=distance, final_weight=0.0
    )
    labels = torch.arange(8) // 2
    levels = [unit(8, EMB, seed=s).requires_grad_() for s in (1, 2, 3)]
    losses = nn.ModuleList(
        create_loss("margin", num_classes=4, embedding_size=EMB) for _ in range(3)
    )
    out = HeadOutput(embedding=levels[-1], levels=levels)
    terms = head.loss_terms(out, TrainingBatch(labels, MetricLoss(losses)))
    for level, emb in enumerate(levels):
        mine = torch.autograd.grad(terms[f"metric_level{level + 1}"], emb, retain_graph=True)[0]
        x = emb.detach().clone().requires_grad_()
        e = F.normalize(x, dim=-1)  # avsl_collector.py line 227
        code = gedml_margin_loss(
            (e[:, None] - e[None]).square().sum(-1), labels, losses[level].beta.detach().double()
        )
        (grad,) = torch.autograd.grad(code, x)
        if distance == "squared":
            torch.testing.assert_close(
                terms[f"metric_level{level + 1}"].double(), code, atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(mine.double(), grad, atol=1e-5, rtol=1e-5)
        else:  # the Euclidean reading is a different number on the same triplets
            assert abs(float(terms[f"metric_level{level + 1}"].detach()) - float(code)) > 1e-2


def test_avsl_protocol_selects_the_codes_arithmetic():
    for dataset in ("cub200", "cars196", "sop"):
        options = load_protocol("avsl").for_dataset(dataset).methods["avsl"]
        assert options["distance"] == "squared"
        assert options["link_ties"] == "code"
        assert options["cam_shift"] == "width_min"


# ------------------------------------------------------ AVSL 4b: SOP ProxyAnchor margins


def gedml_proxy_anchor(metric_mat, labels, num_classes, *, alpha, pos_margin, neg_margin):
    """zbr17/AVSL src/avsl/losses/proxy_anchor_loss.py ``compute_loss`` (lines 61-89) on the
    squared distances to the proxies: per proxy log(1 + sum exp(alpha (d - pos_margin))) over
    its positives and log(1 + sum exp(-alpha (d - neg_margin))) over its negatives; the first
    averaged over the proxies with positives, the second over all."""
    pos_mask = labels[:, None] == torch.arange(num_classes)[None]
    zero = metric_mat.new_zeros(1, num_classes)

    def log1p_sum(logits, mask):
        masked = logits.masked_fill(~mask, -math.inf)
        return torch.logsumexp(torch.cat([masked, zero]), dim=0)

    pos = log1p_sum(alpha * (metric_mat - pos_margin), pos_mask)
    neg = log1p_sum(-alpha * (metric_mat - neg_margin), ~pos_mask)
    with_pos = pos_mask.any(0)
    return pos[with_pos].mean() + neg.mean()


def test_sop_proxy_anchor_has_the_codes_two_margins():
    """samples_avsl.sh line 10: --pa_alpha 16 --pa_pos_margin 1.8 --pa_neg_margin 2.4 (levels),
    --final_pa_neg_margin 2.2 (the final loss), on squared distances of unit vectors."""
    protocol = load_protocol("avsl").for_dataset("sop")
    loss = create_loss(
        "proxy_anchor", protocol.loss_args("proxy_anchor"), num_classes=5, embedding_size=EMB
    )
    loss.proxies.data = torch.randn(5, EMB, generator=gen(4)).double()
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    emb = unit(8, EMB, seed=5).requires_grad_()
    mine = loss(emb, labels)
    g_mine = torch.autograd.grad(mine, [emb, loss.proxies])
    x = emb.detach().clone().requires_grad_()
    proxies = loss.proxies.detach().clone().requires_grad_()
    # avsl_collector.py line 227: both sides normalised, then lines 231-234
    squared = (
        (F.normalize(x, dim=-1)[:, None] - F.normalize(proxies, dim=-1)[None]).square().sum(-1)
    )
    code = gedml_proxy_anchor(squared, labels, 5, alpha=16.0, pos_margin=1.8, neg_margin=2.4)
    g_code = torch.autograd.grad(code, [x, proxies])
    torch.testing.assert_close(mine, code, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_mine, g_code, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The final loss's margin 2.2: 16 (2.2 - d^2) = 32 (cos + 0.1).
    assert protocol.methods["avsl"]["final_neg_margin"] == pytest.approx((2.2 - 2.0) / 2)
    # CUB and Cars: one margin, PML's loss unchanged.
    assert (
        load_protocol("avsl").for_dataset("cub200").loss_args("proxy_anchor")["neg_margin"] == 0.1
    )


# ----------------------------------------------------------------- AVSL 4c: link ties


def code_link_star(link, k):
    """zbr17/AVSL avsl_collector.py lines 241-244 with utils.py ``topk_mask`` (lines 5-8): on the
    code's link (rows: the lower level, columns: the upper one), relu, keep each column's
    entries >= its k-th largest - 1e-8, divide by the kept sum + 1e-8."""
    link = torch.relu(link)
    bound = torch.topk(link, k=k, dim=0)[0].min(dim=0, keepdim=True)[0] - 1e-8
    star = link * (link >= bound)
    return star / (star.sum(dim=0, keepdim=True) + 1e-8)


def test_link_ties_code_keeps_every_edge_tied_at_the_kth():
    edges = torch.randn(6, 10, generator=gen(6), dtype=torch.float64)
    edges[0] = 0.1
    edges[0, 2:6] = 0.5  # four exact ties at the 3rd largest of row 0
    edges[0, :2] = 0.9
    edges[1] = -edges[1].abs()  # a row without positive edges: relu's zeros all tie
    edges[1, 0] = 0.3
    k = 3
    got = normalized_edges(edges, k, ties="code")
    torch.testing.assert_close(got, code_link_star(edges.t(), k).t(), atol=1e-12, rtol=0)
    assert int((got[0] > 0).sum()) == 6  # more than k
    assert int((normalized_edges(edges, k)[0] > 0).sum()) == k  # the harness's "index"


# ----------------------------------------------------------------- AVSL 4d: collector rates


@pytest.mark.parametrize(
    ("dataset", "collector"),
    [
        ("cub200", 0.00011),  # samples_avsl.sh line 2
        ("cars196", 0.09918213648327627),  # samples_avsl.sh line 6
        ("sop", 0.06),  # samples_avsl.sh line 10
    ],
)
def test_the_collector_trains_at_the_scripts_rate(dataset, collector):
    """The collector's parameters (alpha, beta) train at the scripts' ``--lr_collector``,
    whatever the head's rate."""
    options = load_protocol("avsl").for_dataset(dataset).methods["avsl"]
    assert options["collector_lr"] == pytest.approx(collector, rel=1e-12)
    head = create_method("avsl", channels=CHANNELS, embedding_size=EMB, **options)
    groups = {g["name"]: g["lr"] for g in head.optimizer_groups(1e-4, 1e-4)}
    assert groups["inference"] == pytest.approx(collector, rel=1e-12) and groups["head"] == 1e-4


# ---------------------------------------------------------------- AVSL 4e: CAM shift


def test_cam_shift_width_min_is_the_codes_certainty():
    """zbr17/AVSL src/avsl/models/avsl_embedder.py ``compute_certainty``, lines 127-131."""
    cams = torch.randn(2, 5, 4, 6, generator=gen(7), dtype=torch.float64)
    item = cams - cams.min(dim=-1, keepdim=True)[0]
    code = F.normalize(item.flatten(2), dim=-1, p=1).std(dim=-1)
    torch.testing.assert_close(cam_certainty(cams, shift="width_min"), code, atol=1e-12, rtol=0)
    assert (cam_certainty(cams, shift="map") - code).abs().max() > 1e-3


def test_unknown_option_values_list_the_valid_ones():
    for method, option, valid in (
        ("avsl", "link_ties", "index, code"),
        ("avsl", "distance", "euclidean, squared"),
        ("avsl", "cam_shift", "map, width_min"),
        ("diml", "sinkhorn_stop", "converged, diml_code"),
    ):
        with pytest.raises(HarnessError, match=valid) as err:
            create_method(method, channels=CHANNELS, embedding_size=EMB, **{option: "bogus"})
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------ SAM 5: Recall@1000


def test_sam_protocol_prints_sop_recall_at_1000():
    """SAM Table 2 prints Recall@1000 on SOP (results/published/sam.csv)."""
    assert load_protocol("sam").for_dataset("sop").evaluation.recall_k_for("sop") == (
        1,
        10,
        100,
        1000,
    )


# --------------------------------------------------------------- DIABLO 6: renormalize


def test_diablo_has_no_renormalize_option_because_every_loss_normalises():
    with pytest.raises(HarnessError, match="unknown option 'renormalize'.*valid:"):
        build("diablo", renormalize=False)
    emb = unit(8, EMB, seed=8, dtype=torch.float32)
    labels = torch.arange(8) // 2
    for name in (
        "margin",
        "contrastive",
        "triplet",
        "multi_similarity",
        "proxy_anchor",
        "binomial_deviance",
        "circle",
        "lifted_structure",
        "ntxent",
        "proxy_nca",
    ):
        torch.manual_seed(0)
        loss = create_loss(name, num_classes=4, embedding_size=EMB)
        # the raw concatenation of N = 8 unit branches has norm sqrt(8)
        assert float(loss(emb * math.sqrt(8), labels)) == pytest.approx(
            float(loss(emb, labels)), rel=1e-5
        ), name


# --------------------------------------------------------- DIML 8: Sinkhorn stopping


def diml_code_sinkhorn(kernel, u, v):
    """wl-zhao/DIML utilities/diml.py ``Sinkhorn``, lines 4-16: from r = c = 1, r = u / (K c),
    c = v / (K^T r), stop when mean |r - r_prev| < 0.1 (over the whole batch), at most 100."""
    r, c = torch.ones_like(u), torch.ones_like(v)
    for _ in range(100):
        r0 = r
        r = u / torch.matmul(kernel, c.unsqueeze(-1)).squeeze(-1)
        c = v / torch.matmul(kernel.permute(0, 2, 1), r.unsqueeze(-1)).squeeze(-1)
        if (r - r0).abs().mean().item() < 0.1:
            break
    return torch.matmul(r.unsqueeze(-1), c.unsqueeze(-2)) * kernel


def test_diml_code_stopping_rule_gives_the_codes_structural_scores():
    """Near-parallel embeddings: the code's rule stops early; the scores follow
    utilities/diml.py ``calc_similarity`` (lines 24-39, eps 0.05, rows the candidate's cells)
    on the harness's marginals (Eqs. 8-9 with its delta, so only the stopping rule differs)."""
    q, k, n = 3, 5, 16
    base = unit(1, 1, 1, EMB, seed=9)
    q_loc = F.normalize(
        base[0] + 0.08 * torch.randn(q, n, EMB, generator=gen(10), dtype=torch.float64), dim=-1
    )
    c_loc = F.normalize(
        base + 0.08 * torch.randn(q, k, n, EMB, generator=gen(11), dtype=torch.float64), dim=-1
    )
    q_emb, c_emb = F.normalize(q_loc.mean(1), dim=-1), F.normalize(c_loc.mean(2), dim=-1)
    kw = dict(channels=CHANNELS, embedding_size=EMB, add_global=False)
    fields = ({"embedding": q_emb, "local": q_loc}, {"embedding": c_emb, "local": c_loc})
    got = create_method("diml", sinkhorn_stop="diml_code", **kw).rerank_similarity(*fields)
    converged = create_method("diml", sinkhorn_stop="converged", **kw).rerank_similarity(*fields)
    assert create_method("diml", **kw).sinkhorn_stop == "diml_code"  # the reproduction's default
    code = torch.empty(q, k, dtype=torch.float64)
    for i in range(q):
        sim = torch.einsum(
            "cm,ncs->nsm", q_loc[i].t(), c_loc[i].transpose(1, 2)
        )  # N x cand cell x query cell
        u = F.relu(torch.einsum("c,ncr->nr", q_emb[i], c_loc[i].transpose(1, 2))) + 1e-5
        v = F.relu(torch.einsum("cr,nc->nr", q_loc[i].t(), c_emb[i])) + 1e-5
        plan = diml_code_sinkhorn(
            torch.exp(-(1 - sim) / 0.05), u / u.sum(1, keepdim=True), v / v.sum(1, keepdim=True)
        )
        code[i] = (plan * sim).sum((1, 2))
    torch.testing.assert_close(got, code, atol=1e-5, rtol=0)
    assert (converged - code).abs().max() > 1e-5  # the converged rule is another number
