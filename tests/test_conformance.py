"""Conformance suite run once per registered method plugin (CPU, random feature maps).

Every plugin must build from its defaults, embed the feature maps of the stages it
declares, train one step with a real PML loss, explain (or decline to), and offer a
search space over its own options.
"""

from __future__ import annotations

import math

import optuna
import pytest
import torch

from harness.losses import create_loss
from methods import METHODS, HeadOutput, Method, PaperInfo, create_method, list_methods

CHANNELS = {"s8": 16, "s16": 32, "s32": 64}
SIZES = {"s8": (12, 12), "s16": (6, 6), "s32": (3, 3)}
EMB = 32
BATCH = 8
IMAGE = (48, 40)


def feature_maps(stages, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, CHANNELS[s], *SIZES[s], generator=gen) for s in stages]


@pytest.fixture(params=list_methods())
def method(request) -> Method:
    torch.manual_seed(0)
    return create_method(request.param, channels=CHANNELS, embedding_size=EMB)


def test_builds_with_metadata(method):
    assert isinstance(method, Method)
    entry = METHODS.get(method.registry_name)
    assert set(method.stages) <= set(CHANNELS) and method.stages[-1] == "s32"
    assert entry.cls.paper is None or isinstance(entry.cls.paper, PaperInfo)
    assert set(entry.preset) <= set(entry.options())


def test_forward_loss_backward_explain(method):
    labels = torch.arange(BATCH) // 2  # 4 classes x 2
    loss_fn = create_loss("margin", num_classes=4, embedding_size=EMB)
    method.train()
    out = method(feature_maps(method.stages))
    assert isinstance(out, HeadOutput)
    assert out.embedding.shape == (BATCH, EMB)
    torch.testing.assert_close(out.embedding.norm(dim=-1), torch.ones(BATCH), rtol=1e-4, atol=1e-4)

    terms = method.loss_terms(out, labels, lambda emb, lab: loss_fn(emb, lab))
    assert terms and all(t.dim() == 0 and torch.isfinite(t) for t in terms.values())
    sum(terms.values()).backward()
    grads = [p.grad for p in method.parameters() if p.requires_grad]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)

    groups = method.optimizer_groups(1e-3, 1e-4)
    covered = [id(p) for g in groups for p in g["params"]]
    assert len(covered) == len(set(covered))
    assert set(covered) == {id(p) for p in method.parameters() if p.requires_grad}

    method.eval()
    with torch.no_grad():
        out = method(feature_maps(method.stages, seed=1))
        maps = method.explain(torch.rand(BATCH, 3, *IMAGE), out)
    if maps is not None:
        assert maps.dim() == 4 and maps.shape[0] == BATCH and maps.shape[2:] == IMAGE
        assert torch.isfinite(maps).all() and maps.min() >= 0 and maps.max() <= 1


def test_search_space_uses_own_options(method):
    entry = METHODS.get(method.registry_name)
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    params = entry.cls.search_space(trial)
    assert set(params) <= set(entry.options())
    rebuilt = create_method(method.registry_name, channels=CHANNELS, embedding_size=EMB, **params)
    with torch.no_grad():
        out = rebuilt(feature_maps(rebuilt.stages))
    assert math.isclose(float(out.embedding.norm(dim=-1).mean()), 1.0, rel_tol=1e-4)
