"""Networks made ready for ``torch.export`` with the image's height and width left free.

TensorFlow's "same" padding (timm's ``Conv2dSame``, in EfficientNet-Lite0) computes its
padding from the input size with ``math.ceil`` of a division and ``max``: traced with a
symbolic size, that gives a node ``torch.export`` cannot serialise (``math.ceil``) and
nested ``Max`` expressions that take its shape reasoning minutes per layer.
:class:`ExportableConv2dSame` computes the same padding in integer arithmetic, without
``max`` where it is never negative (a kernel at least as wide as its stride), which the
exporter simplifies layer by layer: the same numbers, exported in seconds.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from timm.layers.conv2d_same import Conv2dSame
from torch import nn

__all__ = ["same_padding", "ExportableConv2dSame", "exportable"]


def same_padding(size, kernel: int, stride: int, dilation: int):
    """The total padding of one side pair under "same" padding: the output has
    ``ceil(size / stride)`` positions. ``size`` an int or a symbolic int of ``torch.export``."""
    reach = (kernel - 1) * dilation + 1
    padding = ((size + stride - 1) // stride - 1) * stride + reach - size
    return padding if reach >= stride else torch.sym_max(padding, 0)


class ExportableConv2dSame(Conv2dSame):
    """timm's ``Conv2dSame`` with its padding from :func:`same_padding` (no state of its
    own: a ``Conv2dSame`` takes this class as it is)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2:]
        kernel_h, kernel_w = self.weight.shape[-2:]
        pad_h = same_padding(height, kernel_h, self.stride[0], self.dilation[0])
        pad_w = same_padding(width, kernel_w, self.stride[1], self.dilation[1])
        x = F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


def exportable(network: nn.Module) -> nn.Module:
    """A copy of ``network`` whose "same"-padding convolutions are
    :class:`ExportableConv2dSame`; ``network`` itself is left as it is."""
    network = copy.deepcopy(network)
    for module in network.modules():
        if type(module) is Conv2dSame:
            module.__class__ = ExportableConv2dSame
    return network
