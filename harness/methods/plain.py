"""``plain``: global pooling + one linear layer, L2-normalised: the no-grouping baseline.

This is the standard DML head of Roth et al. 2020 (and N-grouping in A-grouping's
Table 3, "Emb: 1 x 512"). Its ``project`` layer is the "embedding layer" that
DIML applies at every spatial location for its local embeddings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.methods.base import HeadOutput, Method, register_method

if TYPE_CHECKING:
    from optuna.trial import Trial

POOLS = ("avg", "max", "avg+max")


@register_method("plain", description="global pooling + linear (no-grouping baseline)")
class PlainHead(Method):
    """Global pooling (average, max or their sum) then a linear embedding, L2-normalised."""

    label = "Baseline"

    def __init__(self, *, channels, embedding_size, pool: str = "avg"):
        super().__init__(channels=channels, embedding_size=embedding_size)
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.pool = pool
        self.project = nn.Linear(self.in_channels, embedding_size)

    def pooled(self, fmap: torch.Tensor) -> torch.Tensor:
        if self.pool == "avg":
            return fmap.mean(dim=(2, 3))
        if self.pool == "max":
            return fmap.amax(dim=(2, 3))
        return fmap.mean(dim=(2, 3)) + fmap.amax(dim=(2, 3))

    def embed(self, maps: list[torch.Tensor]) -> HeadOutput:
        fmap = maps[-1]
        return HeadOutput(embedding=F.normalize(self.project(self.pooled(fmap)), dim=-1))

    @classmethod
    def search_space(cls, trial: Trial, *, embedding_size: int) -> dict[str, Any]:
        return {"pool": trial.suggest_categorical("pool", list(POOLS))}
