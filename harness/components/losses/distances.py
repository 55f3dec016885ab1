"""A loss or miner on a similarity or distance matrix that a method computes itself."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from pytorch_metric_learning.distances import BaseDistance

__all__ = ["PrecomputedDistance", "distance_replaced"]


class PrecomputedDistance(BaseDistance):
    """A PML distance that returns a given B x B matrix, so that any pair- or triplet-based
    PML loss (and its reducer) runs unchanged on a similarity or distance a method computes
    itself (DIML's combined similarity, AVSL's rectified distance).
    ``is_inverted=True`` for similarities (higher is closer), False for distances."""

    def __init__(self, matrix: torch.Tensor, *, is_inverted: bool):
        super().__init__(normalize_embeddings=False, is_inverted=is_inverted)
        self.matrix = matrix

    def compute_mat(self, query_emb, ref_emb):
        if self.matrix.shape != (len(query_emb), len(query_emb if ref_emb is None else ref_emb)):
            raise ValueError(
                f"precomputed matrix {tuple(self.matrix.shape)} does not match the batch"
            )
        return self.matrix

    def pairwise_distance(
        self, query_emb, ref_emb
    ):  # pragma: no cover - losses here use the matrix
        raise NotImplementedError("PrecomputedDistance only provides the full matrix")


@contextmanager
def distance_replaced(loss: torch.nn.Module, distance: BaseDistance) -> Iterator[torch.nn.Module]:
    """``loss`` (or a miner) computing its matrix with ``distance`` inside the block."""
    old = loss.distance
    loss.distance = distance
    try:
        yield loss
    finally:
        loss.distance = old
