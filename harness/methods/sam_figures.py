"""SAM's figures (Zheng et al., IJCAI 2022, Fig. 4) as data: the similarity attention of
Eq. 1 in closed form from a head's per-location embeddings of the last map, and the row
of images, each with its map."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from harness.methods.figures import FigureData, FigureSet, Panel
from harness.methods.head_data import HeadOutput
from harness.methods.sam_attention import EPS, pair_weights, triplet_weights

__all__ = [
    "attention_row",
    "local_attention_maps",
    "unit_embedding",
    "grid_shape",
    "local_pair_maps",
    "triplet_maps",
    "tuple_figures",
]


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


def _local(out: HeadOutput) -> torch.Tensor:
    """One image's per-location embeddings of the last map (``local``: N x D, W A_ij),
    float32 on the CPU."""
    assert out.local is not None  # the head keeps its local embeddings
    return out.local[0].detach().float().cpu()


@torch.no_grad()
def _local_attention(
    outputs: Sequence[HeadOutput], bias: torch.Tensor, w: torch.Tensor, image_size=(1, 1)
) -> list[torch.Tensor]:
    """:func:`local_attention_maps` of a tuple's head outputs (eval mode)."""
    return local_attention_maps([_local(out) for out in outputs], bias, w, image_size)


def local_pair_maps(
    query: HeadOutput,
    gallery: HeadOutput,
    bias: torch.Tensor,
    *,
    same: bool = True,
    image_size=(1, 1),
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One (query, gallery) pair's similarity attention in closed form from ``local`` and
    the head's Linear ``bias``: two h x w maps under the Siamese weight (w = 1 - |f_q - f_g|
    for ``same``, else |f_q - f_g|); None when the outputs keep no ``local``."""
    if query.local is None or gallery.local is None:
        return None
    w = pair_weights(
        unit_embedding(_local(query), bias), unit_embedding(_local(gallery), bias), same
    )
    q, g = _local_attention([query, gallery], bias, w, image_size)
    return q, g


def triplet_maps(
    anchor: HeadOutput,
    positive: HeadOutput,
    negative: HeadOutput,
    bias: torch.Tensor,
    image_size=(1, 1),
) -> list[torch.Tensor] | None:
    """Fig. 4's maps as data: anchor, positive and negative attention under the triplet
    weight w = (1 - |f_a - f_p|) * |f_a - f_n| (Sec. 3.1)."""
    outputs = (anchor, positive, negative)
    if any(o.local is None for o in outputs):
        return None
    w = triplet_weights(*(unit_embedding(_local(o), bias) for o in outputs))
    return _local_attention(outputs, bias, w, image_size)


def tuple_figures(
    kind: str,
    images: Sequence[torch.Tensor],
    outputs: Sequence[HeadOutput],
    bias: torch.Tensor,
    *,
    stage: str,
) -> FigureSet | None:
    """Fig. 4's layout: each image with its similarity attention (:func:`attention_row`).
    A ``"pair"`` (query, nearest neighbour) under the positive-pair weight
    w = 1 - |f_q - f_g| (:func:`local_pair_maps`); a ``"triplet"`` under the triplet
    weight (:func:`triplet_maps`), whose maps are kept as data too (``.npz``). The maps
    are of ``s32`` whatever the head's ``stage``."""
    size = images[0].shape[-2:]
    if kind == "pair":
        query, gallery = outputs
        pair = local_pair_maps(query, gallery, bias, image_size=size)
        if pair is None:
            return None
        cosine = float(unit_embedding(_local(query), bias) @ unit_embedding(_local(gallery), bias))
        note = "" if stage == "s32" else f" (drawn on s32; trained on {stage})"
        title = f"SAM similarity attention, w = 1 - |f_q - f_g|{note}; cosine {cosine:.3f}"
        return FigureSet(figures=(attention_row(images, pair, ["query", "gallery"], title),))
    anchor, positive, negative = outputs
    maps = triplet_maps(anchor, positive, negative, bias, image_size=size)
    if maps is None:
        return None
    names = ["anchor", "positive", "negative"]
    title = "SAM Fig. 4: triplet attention, w = (1 - |f_a - f_p|) * |f_a - f_n|"
    return FigureSet(
        figures=(attention_row(images, maps, names, title),),
        arrays={"": dict(zip(names, maps, strict=True))},
    )
