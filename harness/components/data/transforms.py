"""Train and eval transforms, named in the protocol (the field's two standard pipelines,
and the multi-scale crop of ABE / DIABLO)."""

from __future__ import annotations

import torch
from torchvision import transforms as T

from harness.base.errors import HarnessError, unknown_name

__all__ = [
    "build_transform",
    "normalize_batch",
    "MultiScaleCrop",
    "TRAIN_TRANSFORMS",
    "EVAL_TRANSFORMS",
]

TRAIN_TRANSFORMS = ("random_resized_crop_flip", "resize_flip", "multiscale_crop_flip")
EVAL_TRANSFORMS = ("resize_center_crop", "resize")


class MultiScaleCrop:
    """Multi-resolution random crop (DIABLO Sec. 3.5: "multi-resolution where the size is
    uniformly sampled in [0.8, 1.8] times the crop size as well as random 256 x 256 crop").

    The image is resized to ``side x side``, ``side = round(s * size)`` with ``s`` uniform
    in ``scale_range`` (a square, as the paper's test-time 256 x 256 rescale), then a
    random ``size x size`` crop is taken. Where the text is silent, the harness's choice:
    when ``s < 1`` the resized image is smaller than the crop, and it is placed at a
    random position on a ``size x size`` canvas of ``fill`` (the normalisation mean, so
    the border is zero after :func:`normalize_batch`). ``s`` is drawn from torch's
    generator, which the training loop seeds per epoch.
    """

    def __init__(self, size: int, scale_range, fill: tuple[int, ...] = (0, 0, 0)):
        low, high = (float(v) for v in scale_range)
        if not 0 < low <= high:
            raise HarnessError(f"multi-scale crop needs 0 < low <= high, got {scale_range!r}")
        self.size, self.low, self.high = int(size), low, high
        self.crop = T.RandomCrop(self.size, pad_if_needed=True, fill=tuple(fill))

    def sample_scale(self) -> float:
        return self.low + (self.high - self.low) * float(torch.rand(()))

    def side(self, scale: float) -> int:
        return max(1, round(scale * self.size))

    def __call__(self, image):
        side = self.side(self.sample_scale())
        return self.crop(T.functional.resize(image, [side, side]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, scale_range=({self.low}, {self.high}))"


def build_transform(image_spec, *, train: bool) -> T.Compose:
    """Roth et al. 2020: train RandomResizedCrop(size)+flip; eval Resize(resize)+CenterCrop(size).
    The training crop takes the protocol's ``crop_scale`` and ``crop_ratio``, after
    Resize(``train_resize``) when that is nonzero.

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
        # ``train_resize``: the shorter side resized first (AVSL's code: Resize(256), then
        # RandomResizedCrop(224, scale 0.16-1, ratio 0.75-1.33); zbr17/AVSL
        # examples/config/param/transforms/train_transforms.yaml lines 4-9).
        resize = [T.Resize(image_spec.train_resize)] if image_spec.train_resize else []
        ratio = tuple(image_spec.crop_ratio)
        ops = [
            *resize,
            T.RandomResizedCrop(size, scale=tuple(image_spec.crop_scale), ratio=ratio),
            T.RandomHorizontalFlip(),
        ]
    elif name == "multiscale_crop_flip":
        fill = tuple(round(255 * m) for m in image_spec.mean)
        ops = [MultiScaleCrop(size, image_spec.multiscale_range, fill), T.RandomHorizontalFlip()]
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
