"""A-grouping and its grouping baselines: golden values of the paper's equations on tiny
random feature maps (CPU, no backbone), plus the explanation helpers."""

from __future__ import annotations

import math

import numpy as np
import optuna
import pytest
import torch
from pytorch_metric_learning import losses as pml_losses

from harness.base.errors import HarnessError
from harness.components.explanation.maps import attention_figure, part_attention_mass, upsample_maps
from harness.components.losses import BinomialDevianceLoss, MetricLoss
from harness.methods import METHODS, TrainingBatch, create_method
from harness.methods.agrouping import GroupingHead, diversity_loss

CHANNELS = {"s32": 64}
EMB = 32
VARIANTS = ("agrouping", "mgrouping", "ggrouping", "cgrouping", "ngrouping")
GROUPS = {"agrouping": 4, "mgrouping": 4, "ggrouping": 4, "cgrouping": 4, "ngrouping": 1}


def make(name="agrouping", **options):
    torch.manual_seed(0)
    return create_method(name, channels=CHANNELS, embedding_size=EMB, **options)


def fmap(batch=6, h=5, w=4, seed=1):
    return torch.randn(batch, CHANNELS["s32"], h, w, generator=torch.Generator().manual_seed(seed))


def labels(batch=6):
    return torch.arange(batch) // 2


# --------------------------------------------------------------------------- forward


def test_permutation_invariance_theorem_1():
    head = make().eval()
    x = fmap()
    b, c, h, w = x.shape
    perm = torch.randperm(h * w, generator=torch.Generator().manual_seed(3))
    x_perm = x.flatten(2)[:, :, perm].reshape(b, c, h, w)
    with torch.no_grad():
        out, out_perm = head([x]), head([x_perm])
    torch.testing.assert_close(out_perm.embedding, out.embedding, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_perm.groups, out.groups, rtol=1e-5, atol=1e-6)
    # the attention moves with the positions
    torch.testing.assert_close(out_perm.attention.flatten(2), out.attention.flatten(2)[:, :, perm])


def test_attention_rows_sum_to_one():
    out = make()([fmap()])
    att = out.attention
    assert att.shape == (6, 4, 5, 4)
    assert (att >= 0).all()
    torch.testing.assert_close(att.sum(dim=(2, 3)), torch.ones(6, 4))


def test_attention_matches_equations_5_to_8():
    """F = Softmax(Q^T K) V^T computed by hand from the module's own weights."""
    head = make(groups=2)
    x = fmap(batch=2, h=3, w=3)
    g = head.grouping
    K = torch.einsum("kc,bcn->bkn", g.key.weight[:, :, 0, 0], x.flatten(2))
    V = torch.einsum("dc,bcn->bdn", g.value.weight[:, :, 0, 0], x.flatten(2))
    A = torch.softmax(torch.einsum("pk,bkn->bpn", g.queries, K), dim=-1)
    F_ = torch.einsum("bpn,bdn->bpd", A, V)
    out = head([x])
    torch.testing.assert_close(
        out.groups, torch.nn.functional.normalize(F_, dim=-1), rtol=1e-5, atol=1e-6
    )
    assert g.key.bias is None and g.value.bias is None
    assert g.key.out_channels == 64 // 8 and g.value.out_channels == EMB // 2


@pytest.mark.parametrize("name", VARIANTS)
def test_shapes_and_per_group_normalisation(name):
    head = make(name)
    out = head([fmap()])
    p = GROUPS[name]
    assert out.embedding.shape == (6, EMB)
    assert out.groups.shape == (6, p, EMB // p)
    torch.testing.assert_close(out.groups.norm(dim=-1), torch.ones(6, p))
    torch.testing.assert_close(out.embedding.norm(dim=-1), torch.ones(6))
    torch.testing.assert_close(out.embedding, out.groups.flatten(1) / math.sqrt(p))
    assert (out.attention is not None) == (name == "agrouping")
    if name == "agrouping":
        assert out.attention.shape == (6, p, 5, 4)


def test_baseline_layers_follow_the_released_code():
    m = make("mgrouping").grouping
    assert m.project.in_features == 64 and m.project.out_features == EMB and m.project.bias is None
    gate = make("ggrouping").grouping
    assert gate.shared.out_channels == 8 and gate.masks.out_channels == 4 * 64
    assert gate.project.out_features == EMB // 4 and gate.project.bias is None
    ch = make("cgrouping").grouping
    assert len(ch.excite) == 4 and ch.excite[0].fc[0].out_features == 64 // 5
    assert ch.project.out_features == EMB // 4 and ch.project.bias is not None
    n = make("ngrouping")
    assert n.groups == 1 and n.grouping.project.out_features == EMB


def test_gate_masks_without_sigmoid_as_in_the_code():
    head = make("ggrouping", gate_sigmoid=False)
    out = head([fmap()])
    assert out.extras["gate_maps"].shape == (6, 4, 5, 4)
    assert (out.extras["gate_maps"] < 0).any()  # raw conv output, not squashed


def test_invalid_options_are_errors():
    with pytest.raises(HarnessError, match="method 'agrouping': groups must divide"):
        make(groups=3)
    with pytest.raises(HarnessError, match="grouping"):
        make(grouping="bogus")
    with pytest.raises(HarnessError, match="diversity_reduction"):
        make(diversity_reduction="sum")
    with pytest.raises(HarnessError, match="unknown option 'lambda1'"):
        make(lambda1=0.1)


# ---------------------------------------------------------------------------- losses


def _hand_diversity(groups, alpha=2.0, margin=0.5, beta=25.0, reduction="mean"):
    """Eq. 4 with plain Python loops over images and group pairs."""
    g = groups.tolist()
    n, p = len(g), len(g[0])

    def cos(u, v):
        dot = sum(a * b for a, b in zip(u, v, strict=True))
        return dot / (math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v)))

    def softplus(t):
        return math.log(1.0 + math.exp(t))

    if reduction == "mean":
        total, count = 0.0, 0
        for b in range(n):
            for i in range(p):
                for j in range(p):
                    if i != j:
                        total += softplus(alpha * beta * (cos(g[b][i], g[b][j]) - margin))
                        count += 1
        return total / count
    # DGML code: per pair i < j the mean over images, summed, divided by P - 1
    total = 0.0
    for i in range(p):
        for j in range(i + 1, p):
            total += (
                sum(softplus(alpha * beta * (cos(g[b][i], g[b][j]) - margin)) for b in range(n)) / n
            )
    return total / (p - 1)


@pytest.mark.parametrize("reduction", ["mean", "dgml"])
def test_diversity_loss_equals_hand_computation(reduction):
    torch.manual_seed(0)
    groups = torch.randn(3, 4, 5, dtype=torch.float64)
    groups[0, 1] = groups[0, 0] + 0.05 * groups[0, 1]  # a near-duplicate pair: cos close to 1
    got = diversity_loss(groups, reduction=reduction)
    assert got.item() == pytest.approx(_hand_diversity(groups, reduction=reduction), rel=1e-5)


def test_diversity_loss_single_group_is_zero_with_graph():
    x = torch.randn(4, 1, 8, requires_grad=True)
    loss = diversity_loss(x)
    assert loss.item() == 0.0 and loss.requires_grad


def test_diversity_is_orthogonality_seeking():
    orthogonal = torch.eye(4).unsqueeze(0)  # 1 x 4 groups x 4 dims, cos = 0
    collapsed = torch.ones(1, 4, 4)  # all groups equal, cos = 1
    assert diversity_loss(orthogonal) < 1e-10 < diversity_loss(collapsed)


def test_per_group_metric_loss_is_the_average_over_groups():
    head = make(diversity_weight=0.0)
    out = head([fmap()])
    loss = BinomialDevianceLoss()
    y = labels()
    calls = []
    loss.register_forward_pre_hook(lambda _module, args: calls.append(args[0]))

    terms = head.loss_terms(out, TrainingBatch(y, MetricLoss(loss)))
    assert set(terms) == {"metric"}
    assert len(calls) == 4 and all(c.shape == (6, EMB // 4) for c in calls)
    expected = sum(loss(out.groups[:, p], y) for p in range(4)) / 4
    torch.testing.assert_close(terms["metric"], expected)


def test_single_group_metric_loss_is_the_plain_metric_loss():
    head = make("ngrouping")
    out = head([fmap()])
    loss = BinomialDevianceLoss()
    terms = head.loss_terms(out, TrainingBatch(labels(), MetricLoss(loss)))
    assert set(terms) == {"metric"}
    torch.testing.assert_close(terms["metric"], loss(out.embedding, labels()))


def test_loss_terms_add_weighted_diversity():
    head = make(diversity_weight=0.5)
    out = head([fmap()])
    terms = head.loss_terms(out, TrainingBatch(labels(), MetricLoss(BinomialDevianceLoss())))
    torch.testing.assert_close(terms["diversity"], 0.5 * diversity_loss(out.groups))


def test_gradients_reach_the_queries():
    head = make()
    out = head([fmap()])
    terms = head.loss_terms(out, TrainingBatch(labels(), MetricLoss(BinomialDevianceLoss())))
    sum(terms.values()).backward()
    for param in (head.grouping.queries, head.grouping.key.weight, head.grouping.value.weight):
        assert param.grad is not None and param.grad.abs().sum() > 0
    # the diversity loss alone moves the queries as well
    head.zero_grad()
    diversity_loss(head([fmap()]).groups).backward()
    assert head.grouping.queries.grad.abs().sum() > 0


# ------------------------------------------------------------------------- optimizer


def test_optimizer_groups_give_the_queries_their_own_weight_decay():
    head = make()
    groups = {g["name"]: g for g in head.optimizer_groups(1e-3, 4e-4)}
    assert set(groups) == {"head", "head.queries"}
    assert groups["head.queries"]["params"] == [head.grouping.queries]
    assert groups["head.queries"]["weight_decay"] == 0.001
    assert groups["head"]["weight_decay"] == 4e-4
    assert all(g["lr"] == 1e-3 for g in groups.values())
    ids = [id(p) for g in groups.values() for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in head.parameters()) and len(set(ids)) == len(ids)
    torch.optim.Adam(list(groups.values()))  # valid parameter groups

    custom = {
        g["name"]: g
        for g in make(query_weight_decay=0.01, head_weight_decay=0.003).optimizer_groups(1e-3, 4e-4)
    }
    assert (
        custom["head.queries"]["weight_decay"] == 0.01 and custom["head"]["weight_decay"] == 0.003
    )


def test_baselines_have_one_head_group():
    groups = make("ggrouping").optimizer_groups(1e-3, 4e-4)
    assert [g["name"] for g in groups] == ["head"] and groups[0]["weight_decay"] == 4e-4


# --------------------------------------------------------------------------- explain


def test_explain_attention_maps_at_image_size():
    head = make()
    out = head([fmap()])
    images = torch.rand(6, 3, 40, 32)
    maps = head.explain(images, out)
    assert maps.shape == (6, 4, 40, 32)
    assert maps.min() >= 0 and maps.max() <= 1
    torch.testing.assert_close(maps.amax(dim=(2, 3)), torch.ones(6, 4))
    torch.testing.assert_close(maps.amin(dim=(2, 3)), torch.zeros(6, 4))
    expected = upsample_maps(out.attention, (40, 32))
    torch.testing.assert_close(maps, expected)


@pytest.mark.parametrize(
    "name,has_maps",
    [("ggrouping", True), ("mgrouping", False), ("cgrouping", False), ("ngrouping", False)],
)
def test_explain_baselines(name, has_maps):
    head = make(name)
    out = head([fmap()])
    maps = head.explain(torch.rand(6, 3, 20, 16), out)
    if has_maps:
        assert maps.shape == (6, 4, 20, 16) and 0 <= maps.min() and maps.max() <= 1
    else:
        assert maps is None


def test_part_attention_mass_hand_example():
    # one image, 2 x 2 map; parts: 0 background (top-left), 1 (top-right), 2 (bottom row)
    part = np.array([[[0, 1], [2, 2]]])
    maps = np.zeros((1, 3, 2, 2))
    maps[0, 0] = [[1, 0], [0, 0]]  # all on background
    maps[0, 1] = [[0, 1], [1, 2]]  # 1/4 on part 1, 3/4 on part 2
    maps[0, 2] = [[0.5, 0.5], [0.5, 0.5]]  # uniform: 1/4, 1/4, 1/2
    got = part_attention_mass(torch.tensor(maps), part)
    expected = np.array([[1, 0, 0], [0, 0.25, 0.75], [0.25, 0.25, 0.5]])
    np.testing.assert_allclose(got, expected)
    # pooled over images, absent parts kept with num_parts
    two = part_attention_mass(
        np.concatenate([maps, maps]), np.concatenate([part, part]), num_parts=4
    )
    assert two.shape == (3, 5)
    np.testing.assert_allclose(two[:, :3], expected)
    np.testing.assert_allclose(two.sum(axis=1), 1.0)
    with pytest.raises(ValueError, match="part_labels"):
        part_attention_mass(maps, part[:, :1])


def test_attention_figure_writes_png(tmp_path):
    head = make()
    out = head([fmap()])
    images = torch.rand(6, 3, 24, 20)
    maps = head.explain(images, out)
    for rank_by in ("mass", "max", "concentration", out.attention.amax(dim=(2, 3))):
        path = attention_figure(
            images, maps, tmp_path / "fig" / "attention.png", top=3, rank_by=rank_by
        )
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="maps"):
        attention_figure(images, maps[:, :, :10], tmp_path / "bad.png")


# ---------------------------------------------------------------------- registry etc.


def test_paper_metadata_and_registry():
    for name in VARIANTS:
        entry = METHODS.get(name)
        assert entry.cls.paper.code_url == "https://github.com/XinyiXuXD/DGML-master"
        assert entry.cls.paper.tables == ("2", "3", "4")
    assert issubclass(METHODS.get("ngrouping").cls, GroupingHead)
    assert METHODS.get("ggrouping").preset == {"grouping": "gate"}


def test_search_space():
    trial = optuna.trial.FixedTrial({"groups": 8, "diversity_weight": 0.02})
    assert GroupingHead.search_space(trial, embedding_size=512) == {
        "groups": 8,
        "diversity_weight": 0.02,
    }
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    params = GroupingHead.search_space(trial, embedding_size=12)
    dist = trial.distributions
    assert dist["groups"].choices == (2, 4)
    weight = dist["diversity_weight"]
    assert weight.log and (weight.low, weight.high) == (1e-3, 0.1)
    create_method("agrouping", channels=CHANNELS, embedding_size=12, **params)
    assert METHODS.get("ngrouping").cls.search_space(trial, embedding_size=12) == {}


def test_each_group_has_its_own_loss_instance_when_the_trainer_holds_one_per_group():
    """DGML-master's criteria keep loss parameters per group (margin beta: groups x classes)."""
    head = make(diversity_weight=0.0)
    assert head.metric_loss_copies == 4 and head.metric_loss_dim == EMB // 4
    assert make(loss_per_group=False).metric_loss_copies == 1
    out = head([fmap()])
    y = labels()
    losses = [
        pml_losses.MarginLoss(num_classes=int(y.max()) + 1, learn_beta=True, beta=1.2)
        for _ in range(4)
    ]
    used = []
    for p, loss in enumerate(losses):
        loss.register_forward_pre_hook(lambda _module, _args, p=p: used.append(p))
    terms = head.loss_terms(out, TrainingBatch(y, MetricLoss(torch.nn.ModuleList(losses))))
    assert used == [0, 1, 2, 3]
    expected = sum(losses[p](out.groups[:, p], y) for p in range(4)) / 4
    torch.testing.assert_close(terms["metric"], expected)
    # Group p's beta moves with group p's loss only.
    (grad0,) = torch.autograd.grad(losses[0](out.groups[:, 0], y), losses[0].beta)
    (grad_term,) = torch.autograd.grad(terms["metric"], losses[0].beta)
    torch.testing.assert_close(grad_term, grad0 / 4)


def test_runs_hold_a_loss_per_group_sized_for_the_groups(workdir, tiny_protocol):
    """Proxies live in the group's space (d = D / P), one set per group; a run trains."""
    from harness.cli.main import main

    out = workdir / "out.json"
    assert (
        main(
            [
                "run",
                "--methods",
                "agrouping",
                "--protocol",
                str(tiny_protocol),
                "--loss",
                "proxy_anchor",
                "--epochs",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (checkpoint,) = workdir.glob("results/checkpoints/*/last.pt")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["loss"]
    proxies = [state[f"{p}.proxies"] for p in range(4)]
    assert all(t.shape[1] == 16 // 4 for t in proxies)  # tiny protocol: D = 16, P = 4
