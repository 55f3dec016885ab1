"""Conformance suite run once per registered method plugin (CPU, a small real backbone).

Every plugin must build from its defaults on a backbone (``setup``), embed the maps
of the points it declares, train one step with the harness's real
:class:`~harness.components.losses.MetricLoss` (per-copy instances, a miner, a loss sized by
``metric_loss_dim``), put every trainable parameter in exactly one optimizer group
(its pretrained copies in the backbone's) and round-trip its state dict. The checks of
each role a plugin declares are ``tests/methods/test_roles.py``'s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.base.errors import HarnessError
from harness.components.backbones import Backbone, BackboneSpec
from harness.components.losses import MetricLoss, create_miner, miner_for
from harness.engine.run.model import EmbeddingModel, create_criterion
from harness.methods import (
    METHODS,
    HeadOutput,
    LossShaper,
    Method,
    PaperInfo,
    TrainingBatch,
    TrainsAsAnother,
    check_method_options,
    list_methods,
)
from harness.methods.roles import loss_copies, loss_dim

EMB = 32
BATCH = 8
IMAGE = (96, 80)


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


def toy_backbone(seed: int = 0) -> Backbone:
    """s8 / s16 / s32 points of widths 16 / 32 / 64, BatchNorm frozen as in the protocols."""
    torch.manual_seed(seed)
    body = nn.Module()
    body.stem = nn.Sequential(_block(3, 8, 2), _block(8, 16, 2), _block(16, 16, 2))
    body.stage3, body.stage4 = _block(16, 32, 2), _block(32, 64, 2)
    spec = BackboneSpec((("s8", 16, ("stem",)), ("s16", 32, ("stage3",)), ("s32", 64, ("stage4",))))
    return Backbone("toy", body, spec, freeze_bn=True)


def build(name: str, seed: int = 0, **options) -> EmbeddingModel:
    """The trainer's model (:meth:`EmbeddingModel.assemble`) on the toy backbone."""
    return EmbeddingModel.assemble(toy_backbone(seed), name, embedding_size=EMB, options=options)


def images(seed: int = 0) -> torch.Tensor:
    return torch.randn(BATCH, 3, *IMAGE, generator=torch.Generator().manual_seed(seed))


def run_loss(head: Method, loss: str) -> MetricLoss:
    """The trainer's metric loss (:func:`~harness.engine.run.model.create_criterion`) for 4
    classes, with the miner a protocol of distance-weighted sampling gives ``loss``."""
    miner = create_miner(*miner_for(loss, "distance_weighted"))
    return MetricLoss(create_criterion(head, loss, num_classes=4), miner)


@pytest.fixture(params=list_methods())
def name(request) -> str:
    return request.param


def test_builds_with_metadata(name):
    model = build(name)
    head = model.head
    entry = METHODS.get(name)
    assert isinstance(head, Method)
    assert head.stages and set(head.stages) <= set(model.backbone.points)
    assert model.backbone.out_stages == tuple(head.stages)
    assert entry.cls.paper is None or isinstance(entry.cls.paper, PaperInfo)
    assert set(entry.preset) <= set(entry.options())
    assert loss_copies(head) >= 1 and loss_dim(head) >= 1


@pytest.mark.parametrize("loss", ["margin", "proxy_anchor"])
def test_forward_loss_backward_and_optimizer_groups(name, loss):
    model = build(name).train()
    head = model.head
    supported = head.supported_losses if isinstance(head, LossShaper) else None
    if supported is not None and loss not in supported:
        with pytest.raises(HarnessError, match=f"cannot train with loss '{loss}'"):
            check_method_options(name, {}, embedding_size=EMB, loss=loss)
        loss = supported[0]
    labels = torch.arange(BATCH) // 2  # 4 classes x 2
    metric_loss = run_loss(head, loss)
    x = images()
    out = model(x)
    assert isinstance(out, HeadOutput)
    assert out.embedding.shape == (BATCH, EMB)
    torch.testing.assert_close(out.embedding.norm(dim=-1), torch.ones(BATCH), rtol=1e-4, atol=1e-4)

    terms = head.loss_terms(out, TrainingBatch(labels, metric_loss, x, model))
    assert terms and all(t.dim() == 0 and torch.isfinite(t) for t in terms.values())
    sum(terms.values()).backward()
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)

    groups = head.optimizer_groups(1e-3, 1e-4)
    in_groups = [id(p) for g in groups for p in g["params"]]
    pretrained = {id(p) for p in head.pretrained.parameters() if p.requires_grad}
    assert len(in_groups) == len(set(in_groups)) and not set(in_groups) & pretrained
    assert set(in_groups) | pretrained == {id(p) for p in head.parameters() if p.requires_grad}


def test_state_dict_round_trip_gives_the_same_embedding(name):
    model = build(name).train()
    labels = torch.arange(BATCH) // 2
    head = model.head
    # One optimizer step so that buffers and parameters differ from a fresh build.
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    metric_loss = run_loss(head, "margin")
    x = images()
    sum(head.loss_terms(model(x), TrainingBatch(labels, metric_loss, x, model)).values()).backward()
    optim.step()
    other = build(name, seed=1)
    other.load_state_dict(model.state_dict())
    model.eval(), other.eval()
    with torch.no_grad():
        torch.testing.assert_close(other(images(1)).embedding, model(images(1)).embedding)


def _trains_as(name: str):
    entry = METHODS.get(name)
    cls = entry.cls
    return cls.trains_as(entry.options()) if issubclass(cls, TrainsAsAnother) else None


@pytest.mark.parametrize("name", [n for n in list_methods() if _trains_as(n) is not None])
def test_a_method_that_trains_as_another_trains_step_for_step_like_it(name):
    """``run`` trains a method that declares ``trains_as`` only once, as that method
    (training-free DIML as ``plain``): the same weights, loss, gradients and optimizer groups."""
    base, options = _trains_as(name)
    model, reference = build(name).train(), build(base, **options).train()
    weights = reference.state_dict()
    assert model.state_dict().keys() == weights.keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=0)
    labels, x = torch.arange(BATCH) // 2, images()
    totals = []
    for m in (model, reference):
        torch.manual_seed(0)  # the miner's draws
        terms = m.head.loss_terms(m(x), TrainingBatch(labels, run_loss(m.head, "margin"), x, m))
        totals.append(sum(terms.values()))
        totals[-1].backward()
    torch.testing.assert_close(totals[0], totals[1], rtol=0, atol=0)
    grads = dict(reference.named_parameters())
    for key, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[key].grad, rtol=0, atol=0)

    def layout(head):
        return [
            (g["lr"], g["weight_decay"], [tuple(p.shape) for p in g["params"]])
            for g in head.optimizer_groups(1e-3, 1e-4)
        ]

    assert layout(model.head) == layout(reference.head)


def test_every_method_declares_a_row_label_of_its_own():
    """Tables label rows only by what plugins declare: every registered method (and variant)
    has a label under its default options, no two alike, and a label that names an option
    takes the run's value of it."""
    labels = {name: METHODS.get(name).display_name() for name in list_methods()}
    assert all(labels.values()) and len(set(labels.values())) == len(labels)
    assert METHODS.get("diablo").display_name({"entries": "2"}) == "+ DIABLO (N = 2)"
    assert labels["diablo"] == "+ DIABLO (N = 8)" and labels["diablo_n16"] == "+ DIABLO (N = 16)"
