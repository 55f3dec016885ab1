"""Backbones: stage shapes, real offline weights for EfficientNet-Lite0, frozen BN, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from harness.base.errors import HarnessError
from harness.components.backbones import BACKBONES, create_backbone, efficientnet_lite0_state_dict

REPO = Path(__file__).resolve().parents[2]
STRIDES = {"s8": 8, "s16": 16, "s32": 32}


@pytest.mark.parametrize("name", BACKBONES.list())
def test_stages_have_declared_channels_and_strides(name):
    backbone = create_backbone(name, pretrained=False, out_stages=("s8", "s16", "s32")).eval()
    with torch.no_grad():
        maps = backbone(torch.randn(1, 3, 128, 128))
    assert backbone.out_stages == ("s8", "s16", "s32")
    for stage, fmap in zip(backbone.out_stages, maps, strict=True):
        assert fmap.shape[1] == backbone.channels[stage]
        assert fmap.shape[-1] == 128 // STRIDES[stage]


@pytest.mark.parametrize("name", ["efficientnet_lite0", "resnet18"])
def test_output_stride_16_doubles_the_last_map_with_the_same_weights(name):
    """The smoke protocol's 6 x 6 map at 96 px: the last stage dilated, not strided. The
    parameters are the strided network's, key for key and value for value, so the
    ImageNet weights apply unchanged; the earlier stages are the same computation."""
    torch.manual_seed(0)
    strided = create_backbone(name, pretrained=False, out_stages=("s16", "s32")).eval()
    dilated = create_backbone(name, pretrained=False, output_stride=16, out_stages=("s16", "s32"))
    dilated.load_state_dict(strided.state_dict(), strict=True)
    dilated.eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        (s16, s32), (d16, d32) = strided(x), dilated(x)
    assert s32.shape[-2:] == (3, 3) and d32.shape[-2:] == (6, 6)
    assert d32.shape[1] == s32.shape[1]
    torch.testing.assert_close(d16, s16)  # before the dilated stage nothing differs


def test_output_stride_16_is_refused_where_the_backbone_cannot_dilate():
    with pytest.raises(HarnessError, match="'googlenet' has only output stride 32"):
        create_backbone("googlenet", pretrained=False, output_stride=16)


def test_required_backbones_are_registered():
    assert {"resnet50", "resnet18", "googlenet", "efficientnet_lite0"} <= set(BACKBONES.list())


def test_efficientnet_lite0_real_weights_load_strict():
    import timm

    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    state = efficientnet_lite0_state_dict()
    model.load_state_dict(state, strict=True)  # every key mapped, none left over
    # Real ImageNet weights, not an initialisation: a trained stem has structure.
    stem = state["conv_stem.weight"]
    assert stem.shape == (32, 3, 3, 3)
    assert not torch.allclose(stem, timm.create_model("tf_efficientnet_lite0").conv_stem.weight)
    assert not torch.allclose(state["bn1.running_var"], torch.ones(32))  # real BN statistics
    model.eval()
    from harness.components.data.synthetic import make_classes, render

    image, _ = render(make_classes(np.random.default_rng(0), 1)[0], np.random.default_rng(0), 224)
    x = (torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255 - 0.5) / 0.5
    with torch.no_grad():  # trained ImageNet logits on a structured image are far from uniform
        logits = model(x)
    assert torch.isfinite(logits).all() and logits.std() > 0.5


def test_frozen_bn_stays_in_eval_mode_but_keeps_training_affine():
    backbone = create_backbone("resnet18", pretrained=False, freeze_bn=True).train()
    bns = [m for m in backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(not bn.training for bn in bns)
    assert all(bn.weight.requires_grad for bn in bns)
    before = bns[0].running_mean.clone()
    backbone(torch.randn(2, 3, 64, 64))
    assert torch.equal(before, bns[0].running_mean)
    unfrozen = create_backbone("resnet18", pretrained=False, freeze_bn=False).train()
    assert all(m.training for m in unfrozen.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_unavailable_pretrained_weights_fail_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        HarnessError, match="pretrained weights for backbone 'resnet50' are not available offline"
    ):
        create_backbone("resnet50", pretrained=True)


# A hub that refuses connections at once, a cache of its own, and offline mode off: what
# a machine without a network sees, without waiting on name resolution.
UNREACHABLE_HUB = "http://127.0.0.1:9"
HUB_SCRIPT = """
import sys, torch
from harness.base.errors import HarnessError
from harness.components.backbones import create_backbone
try:
    backbone = create_backbone("resnet18", pretrained=True)
except HarnessError as err:
    print("refused:", err)
    sys.exit(3)
print("conv1 sum:", float(backbone.body.conv1.weight.sum()))
"""


def run_with_hub_cache(cache: Path) -> subprocess.CompletedProcess[str]:
    # No proxy either: behind one the hub is not probed but asked.
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "HF_HUB_OFFLINE" and not k.lower().endswith("_proxy")
    }
    env.update(HF_ENDPOINT=UNREACHABLE_HUB, HF_HUB_CACHE=str(cache), PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", HUB_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )


def test_missing_hub_weights_fail_at_once_without_retrying_the_hub(tmp_path):
    done = run_with_hub_cache(tmp_path / "hub")
    assert done.returncode == 3, done.stderr
    assert "pretrained weights for backbone 'resnet18' are not available offline" in done.stdout
    assert "Retrying" not in done.stderr


def test_cached_hub_weights_load_without_asking_the_hub(tmp_path):
    source = create_backbone("resnet18", pretrained=False)
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--timm--resnet18.tv_in1k"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    state = {k: v.contiguous() for k, v in source.body.state_dict().items()}
    save_file(state, str(snapshot / "model.safetensors"))
    done = run_with_hub_cache(tmp_path / "hub")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"conv1 sum: {float(source.body.conv1.weight.detach().sum())}" in done.stdout
    assert "Retrying" not in done.stderr


def test_weights_file_is_loaded_safely(tmp_path):
    source = create_backbone("resnet18", pretrained=False)
    path = tmp_path / "r18.pth"
    torch.save(source.body.state_dict(), path)
    loaded = create_backbone("resnet18", pretrained=True, weights=str(path))
    assert torch.equal(loaded.body.conv1.weight, source.body.conv1.weight)
    with pytest.raises(HarnessError, match="backbone.weights file not found"):
        create_backbone("resnet18", pretrained=True, weights=str(tmp_path / "missing.pth"))


def test_unknown_backbone_lists_valid_names():
    with pytest.raises(HarnessError, match="unknown backbone 'resnet5'.*resnet50"):
        create_backbone("resnet5", pretrained=False)
