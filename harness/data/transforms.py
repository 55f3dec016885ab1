"""Train and eval transforms, named in the protocol (the field's two standard pipelines)."""

from __future__ import annotations

import torch
from torchvision import transforms as T

from ..errors import HarnessError, unknown_name

__all__ = ["build_transform", "normalize_batch", "TRAIN_TRANSFORMS", "EVAL_TRANSFORMS"]

TRAIN_TRANSFORMS = ("random_resized_crop_flip", "resize_flip")
EVAL_TRANSFORMS = ("resize_center_crop", "resize")


def build_transform(image_spec, *, train: bool) -> T.Compose:
    """Roth et al. 2020: train RandomResizedCrop(size)+flip; eval Resize(resize)+CenterCrop(size).

    Returns uint8 C x H x W tensors: scaling and mean/std normalisation happen once per
    batch on the device (:func:`normalize_batch`), which is cheaper than per image and
    moves a quarter of the bytes to a GPU.
    """
    size, resize = image_spec.size, image_spec.resize
    name = image_spec.train_transform if train else image_spec.eval_transform
    valid = TRAIN_TRANSFORMS if train else EVAL_TRANSFORMS
    if name not in valid:
        raise unknown_name("train transform" if train else "eval transform", name, valid)
    if name == "random_resized_crop_flip":
        ops = [T.RandomResizedCrop(size, scale=tuple(image_spec.crop_scale)), T.RandomHorizontalFlip()]
    elif name == "resize_flip":
        ops = [T.Resize((size, size)), T.RandomHorizontalFlip()]
    elif name == "resize_center_crop":
        ops = [T.Resize(resize), T.CenterCrop(size)]
    elif name == "resize":
        ops = [T.Resize((size, size))]
    else:  # pragma: no cover - guarded above
        raise HarnessError(name)
    return T.Compose([*ops, T.PILToTensor()])


def normalize_batch(images: torch.Tensor, image_spec) -> torch.Tensor:
    """uint8 B x 3 x H x W -> float, scaled to [0, 1] and normalised by the protocol's mean/std."""
    mean = torch.tensor(image_spec.mean, device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(image_spec.std, device=images.device).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean) / std
