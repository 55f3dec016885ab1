"""Test images run through a trained model for the figures logged with a run: the batch as
the model takes it and as pictures to draw, the head's outputs, the first image's nearest
neighbour, a test triplet, and the share of a map's mass on each part where the dataset
has part masks. Generic over plugins: a model is anything whose call returns a head output
(``embedding``, ``attention``, ``select``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from harness.components.data.synthetic import load_part_mask
from harness.components.data.transforms import build_transform, normalize_batch
from harness.components.explanation.maps import part_attention_mass, upsample_maps

__all__ = [
    "ImageBatch",
    "run_test_images",
    "nearest_neighbour",
    "first_test_triplet",
    "part_shares",
]


@dataclass(frozen=True, eq=False)
class ImageBatch:
    """Test images through a model: ``images`` as it took them (B x 3 x H x W, normalised,
    on its device), ``pictures`` to draw (the same in [0, 1], on the CPU) and the head's
    ``output`` for the batch."""

    images: torch.Tensor
    pictures: torch.Tensor
    output: Any


def run_test_images(
    model, split, image_spec, indices: Sequence[int], device: torch.device
) -> ImageBatch:
    """The test images ``indices`` of ``split``, transformed for evaluation, through ``model``.
    Gradients stay on: a head's explanation may differentiate its output."""
    transform = build_transform(image_spec, train=False)
    images = normalize_batch(
        torch.stack([transform(split.read(i)) for i in indices]).to(device), image_spec
    )
    mean = torch.tensor(image_spec.mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(image_spec.std, device=device).view(1, 3, 1, 1)
    return ImageBatch(images, (images * std + mean).clamp(0, 1).cpu(), model(images))


def nearest_neighbour(embedding: torch.Tensor) -> int:
    """The index of the first row's most similar other row (inner product)."""
    return 1 + int((embedding[1:] @ embedding[0]).argmax())


def first_test_triplet(labels: np.ndarray) -> tuple[int, int, int] | None:
    """(anchor, positive, negative) test indices: the first image, the next of its class,
    the first of another class; None when the split has no such triplet."""
    labels = np.asarray(labels)
    same = np.flatnonzero(labels == labels[0])
    other = np.flatnonzero(labels != labels[0])
    if len(same) < 2 or not len(other):
        return None
    return 0, int(same[1]), int(other[0])


def part_shares(splits, image_spec, maps: torch.Tensor, count: int) -> np.ndarray | None:
    """Per map group of the first ``count`` test images, the share of its mass on the
    background and on each part (groups x (1 + parts)): ``maps`` (B x G x h x w) upsampled
    to the image without re-normalisation, negatives clipped; None when the dataset has no
    part masks."""
    masks = splits.extras.get("masks")
    if not masks:
        return None
    labels = []
    for i in range(count):
        mask = load_part_mask(splits.extras["root"], masks[splits.test.keys()[i]])
        mask = TF.center_crop(
            TF.resize(
                torch.from_numpy(mask.copy())[None],
                image_spec.resize,
                interpolation=InterpolationMode.NEAREST,
            ),
            image_spec.size,
        )
        labels.append(mask[0])
    size = image_spec.size
    mass_maps = upsample_maps(maps.float(), (size, size), normalize=False).clamp_min(0).cpu()
    return part_attention_mass(
        mass_maps, torch.stack(labels), num_parts=len(splits.extras["parts"])
    )
