"""SAM's figures (Zheng et al., IJCAI 2022, Fig. 4) as data: the similarity attention of
Eq. 1 in closed form from a head's per-location embeddings of the last map, and the row
of images, each with its map."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from harness.methods.figures import FigureData, Panel
from harness.methods.sam_attention import EPS

__all__ = ["attention_row", "local_attention_maps", "unit_embedding", "grid_shape"]


def unit_embedding(local: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """f = e / |e| of one image from its per-location embeddings (``local`` N x D, W A_ij)
    and the Linear's ``bias``: e = mean_ij W A_ij + b (GAP commutes with the Linear)."""
    return F.normalize(local.mean(0) + bias, dim=-1)


def local_attention_maps(
    locals_: Sequence[torch.Tensor], bias: torch.Tensor, w: torch.Tensor, image_size=(1, 1)
) -> list[torch.Tensor]:
    """Eq. 1 in closed form for each image of a tuple under the tuple's weight ``w``, from
    its per-location embeddings of the last map (N x D each, W A_ij) and the Linear's
    ``bias``: with e = mean_ij W A_ij + b and f = e / |e|, ds/dA_ij = W^T g / HW for
    g = (w - (w.f) f) / |e| at every location, so M = ReLU(sum_ij (W A_ij) . g) / HW.
    Returns one h x w map per image; ``image_size`` (H, W) gives the map's aspect (its
    h x w grid, :func:`grid_shape`)."""
    maps = []
    for loc in locals_:
        e = loc.mean(0) + bias
        f = F.normalize(e, dim=-1)
        g = (w - (w @ f) * f) / e.norm().clamp_min(EPS)
        maps.append((F.relu(loc @ g) / len(loc)).view(*grid_shape(len(loc), *image_size)))
    return maps


def grid_shape(n: int, height: int, width: int) -> tuple[int, int]:
    """The h x w grid (h * w = n) whose aspect is closest to the image's."""
    shapes = [(h, n // h) for h in range(1, n + 1) if n % h == 0]
    return min(shapes, key=lambda s: abs(math.log(s[0] / s[1]) - math.log(height / width)))


def attention_row(images, maps, names, title: str = "") -> FigureData:
    """Fig. 4's layout as data: images side by side, each with its attention map (h x w)
    over it, titled by ``names``. Images: 3 x H x W in [0, 1]."""
    return FigureData(
        (
            tuple(
                Panel(image, heat, name)
                for image, heat, name in zip(images, maps, names, strict=True)
            ),
        ),
        title=title,
    )
