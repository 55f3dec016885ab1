"""The ledgers' entries checked on the run as built (harness.engine.audit.built_run): each cell
family's model, optimizer, scheduler, loss and sampler on tiny labels, and what they show
of each entry's key; and the settings that only a built run can show (BatchNorm's
weights, the baseline's pooling and initialisation, AVSL's clipping units, DIML's grid)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.components.gradients import clip_gradients, clip_units
from harness.config.ledger import check_ledger, list_ledgers, load_ledger, same_value
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol
from harness.engine.audit.built_run import (
    UNOBSERVED,
    build_run,
    claim_holds,
    observe,
    observes,
)

#: Keys of model, optimizer, loader and loss properties: every entry on one of them that
#: claims "matched" must be observed on the built run. The loss reductions are golden-value
#: tested against the seeds' arithmetic (tests/components/test_dgml_arithmetic.py,
#: test_code_arithmetic.py), not read back from a built loss.
_PROPERTY_PREFIXES = (
    "backbone.freeze_bn",
    "embedding.",
    "sampling.",
    "optimizer.",
    "schedule.milestones",
    "schedule.gamma",
    "loss.args.",
    "image.size",
    "image.crop_",
    "image.train_resize",
    "image.multiscale_range",
    "methods.plain.",
    "methods.avsl.clip_units",
    "methods.avsl.collector_lr",
    "methods.avsl.proxies_in_collector",
)


def _is_property(key: str) -> bool:
    return key.startswith(_PROPERTY_PREFIXES) and not key.endswith(".reduction")


@pytest.mark.slow
@pytest.mark.parametrize("paper", list_ledgers())
def test_every_entry_holds_on_the_built_run(paper):
    """A matched entry's value, and a deviating entry's harness value, is what the built
    run does; an entry's ``observe`` claim holds."""
    runs = {}
    wrong, unseen = [], set()
    for check in check_ledger(load_ledger(paper)):
        entry, case = check.entry, check.case
        if not (observes(entry.key) or entry.observe):
            continue
        marker = (case.family, case.method, case.loss)
        if marker not in runs:
            runs[marker] = build_run(case.protocol, case.method, case.loss)
        run = runs[marker]
        if entry.observe and not claim_holds(run, entry.observe):
            wrong.append(f"{marker}: {entry.setting}: {entry.observe} does not hold")
        if not observes(entry.key):
            continue
        got = observe(run, entry.key)
        if got is UNOBSERVED:
            if check.status == "matched" and _is_property(entry.key):
                unseen.add(f"{marker[1]}/{marker[2]}: {entry.key}")
            continue
        want = entry.value if check.status == "matched" else check.actual
        if not same_value(got, want):
            wrong.append(f"{marker}: {entry.key} built {got!r}, entry says {want!r}")
    assert not wrong, "\n".join(wrong)
    assert not unseen, "matched entries the built run cannot show:\n" + "\n".join(sorted(unseen))


def test_every_matched_property_entry_has_an_observer():
    missing = sorted(
        {
            f"ledger {paper}: {c.entry.key}"
            for paper in list_ledgers()
            for c in check_ledger(load_ledger(paper))
            if c.status == "matched" and _is_property(c.entry.key) and not observes(c.entry.key)
        }
    )
    assert not missing, missing


# ------------------------------------------------------------ BatchNorm affine


def _avsl(dataset="cub200", method="avsl", loss="proxy_anchor"):
    return load_protocol("avsl").for_dataset(dataset), method, loss


def test_frozen_batchnorm_affine_leaves_no_bn_weight_trained():
    protocol, method, loss = _avsl()
    run = build_run(protocol, method, loss)
    norms = [m for m in run.model.backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    assert len(norms) == 53
    assert all(not m.weight.requires_grad and id(m.weight) not in held for m in norms)
    assert observe(run, "backbone.freeze_bn_affine") is True
    run.model.train()
    assert not any(m.training for m in norms)


def test_roth_frozen_batchnorm_still_trains_its_weights():
    protocol = load_protocol("diml")
    run = build_run(protocol, "plain", "margin")
    norms = [m for m in run.model.backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    assert all(m.weight.requires_grad and id(m.bias) in held for m in norms)
    assert observe(run, "backbone.freeze_bn_affine") is False
    assert observe(run, "backbone.freeze_bn") is True


# ----------------------------------------------------------- the baseline head


def test_avsl_baseline_head_pools_average_plus_max_with_kaiming_weights():
    protocol, _, loss = _avsl()
    run = build_run(protocol, "plain", loss)
    layer = run.model.head.project
    assert not layer.bias.any()
    assert (
        abs(float(layer.weight.std()) - (2 / layer.out_features) ** 0.5)
        < 0.05 * (2 / layer.out_features) ** 0.5
    )
    fmap = torch.randn(2, 2048, 7, 7)
    with torch.no_grad():
        got = run.model.head.embed([fmap]).embedding
        want = F.normalize(layer(fmap.mean((2, 3)) + fmap.amax((2, 3))), dim=-1)
    assert torch.allclose(got, want, atol=1e-6)
    assert observe(run, "methods.plain.pool") == "avg+max"
    default = build_run(load_protocol("diml"), "plain", "margin")
    assert observe(default, "methods.plain.init") == "default"
    assert observe(default, "methods.plain.pool") == "avg"


# ------------------------------------------------------------ clipping units


@pytest.mark.parametrize("loss", ["margin", "proxy_anchor"])
def test_avsl_clips_its_collector_as_one_unit_and_each_loss_copy_alone(loss):
    """link_avsl_*.yaml gradclipper: trunk, embedder, collector, and each loss."""
    protocol, method, _ = _avsl()
    run = build_run(protocol, method, loss)
    head = run.model.head
    collector = {id(p) for p in (*head.alphas.parameters(), *head.betas.parameters())}
    proxies = {id(p) for n, p in run.criterion.named_parameters() if n.endswith("proxies")}
    units = [{id(p) for p in u} for u in clip_units(run.optimizer)]
    assert (collector | proxies) in units
    copies = list(run.criterion) if isinstance(run.criterion, nn.ModuleList) else [run.criterion]
    for copy in copies:
        rest = {id(p) for p in copy.parameters()} - proxies
        assert not rest or rest in units
    assert observe(run, "methods.avsl.clip_units") == "code"
    # each unit's gradient norm is clipped to 10 on its own
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    clip_gradients(run.optimizer, 10.0)
    for unit in clip_units(run.optimizer):
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in unit]))
        assert float(norm) == pytest.approx(10.0, rel=1e-3)  # float32 sums of 25M terms


def test_the_group_clipping_keeps_alpha_beta_and_proxies_apart():
    protocol, method, loss = _avsl()
    options = {**protocol.methods["avsl"], "clip_units": "group"}
    run = build_run(protocol, method, loss, options)
    assert len(clip_units(run.optimizer)) == len(run.optimizer.param_groups)
    assert observe(run, "methods.avsl.clip_units") == "group"


# --------------------------------------------------------------- DIML's grid


def test_diml_code_grid_pool_is_the_released_upsample_and_average():
    """evaluation/eval_diml.py:14-20, 37-39: the Linear at every location of the 7 x 7 map,
    then Upsample(16, bilinear, corners aligned) and AdaptiveAvgPool(4)."""
    from harness.methods import create_method

    torch.manual_seed(0)
    head = create_method("diml", channels={"s32": 32}, embedding_size=8, grid_pool="code")
    fmap = torch.randn(3, 32, 7, 7)
    projected = head.project(fmap.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    pooled = nn.AdaptiveAvgPool2d(4)(
        nn.Upsample(size=16, mode="bilinear", align_corners=True)(projected)
    )
    want = F.normalize(pooled.flatten(2).transpose(1, 2), dim=-1)
    with torch.no_grad():
        assert torch.allclose(head.local_grid(fmap), want, atol=1e-5)
        roi = create_method("diml", channels={"s32": 32}, embedding_size=8)
        roi.load_state_dict(head.state_dict())
        cosines = (roi.local_grid(fmap) * want).sum(-1)
    assert float(cosines.max()) < 1 - 1e-4  # ROI Align's cells are other averages


def test_diml_code_marginals_divide_by_the_sum_plus_delta():
    """utilities/diml.py:32-36: relu(a) / (sum + 1e-5); the balanced default sums to 1."""
    from harness.methods.diml_matching import normalized_weights

    weights = torch.tensor([[0.5, 0.0, 1.5], [0.0, 0.0, 0.0]])
    code = normalized_weights(weights, "code")
    assert torch.allclose(code[0], weights[0] / (2.0 + 1e-5))
    assert not code[1].any()
    balanced = normalized_weights(weights, "balanced")
    assert torch.allclose(balanced.sum(-1), torch.ones(2))


@pytest.mark.parametrize("clip_steps", ["every", "first"])
def test_the_built_run_shows_which_steps_clip(clip_steps):
    protocol, method, loss = _avsl()
    protocol, _ = apply_overrides(protocol, {"optimizer.clip_steps": clip_steps})
    assert observe(build_run(protocol, method, loss), "optimizer.clip_steps") == clip_steps


@pytest.mark.parametrize("normalize", [True, False])
def test_the_built_run_shows_whether_the_groups_are_normalised(normalize):
    protocol = load_protocol("agrouping")
    options = {**protocol.methods.get("mgrouping", {}), "normalize_groups": normalize}
    run = build_run(protocol, "mgrouping", "margin", options)
    assert observe(run, "methods.mgrouping.normalize_groups") is normalize
    assert observe(run, "methods.agrouping.normalize_groups") is UNOBSERVED
    run.model.eval()
    with torch.no_grad():
        output = run.model(torch.randn(2, 3, 64, 64))
    norms = output.embedding.norm(dim=-1)  # unit norm either way: what is evaluated
    assert torch.allclose(norms, torch.ones(2), atol=1e-5)


@pytest.mark.parametrize(("after", "epochs", "opens"), [(0, 100, 0), (49, 100, 49), (49, 10, 9)])
def test_the_built_run_shows_the_selection_window(after, epochs, opens):
    protocol, _ = apply_overrides(
        load_protocol("agrouping"), {"selection.after_epoch": after, "schedule.epochs": epochs}
    )
    assert observe(build_run(protocol, "agrouping", "margin"), "selection.after_epoch") == opens
