"""The trained embedder as a model of its own: images in, embeddings out.

:class:`ImageEmbedder` wraps a run's selected weights with the protocol's input
normalisation, so that a user who loads the logged MLflow model
(``mlflow.pytorch.load_model``) gets the embeddings the harness evaluated from images
prepared by the protocol's evaluation transform (resize and centre crop), with no
harness settings to repeat. The plain ``model.pt`` checkpoint (state dict only) stays
the file ``--init-from`` and ``--resume`` read.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from harness.components.data.transforms import normalize_batch

__all__ = ["ImageEmbedder", "example_images"]


class ImageEmbedder(nn.Module):
    """uint8 images B x 3 x S x S (the protocol's evaluation crop) -> B x D float32
    L2-normalised embeddings, the ones retrieval ranks by."""

    def __init__(self, model: nn.Module, image_spec):
        super().__init__()
        self.model = model
        self.image_spec = image_spec

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        batch = normalize_batch(images, self.image_spec).contiguous(
            memory_format=torch.channels_last
        )
        return self.model(batch).embedding.float()


def example_images(image_size: int, count: int = 2, seed: int = 0) -> np.ndarray:
    """``count`` random uint8 images of the protocol's evaluation size (an input example)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(count, 3, image_size, image_size), dtype=np.uint8)
