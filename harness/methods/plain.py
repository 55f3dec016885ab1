"""``plain``: global pooling + one linear layer, L2-normalised: the no-grouping baseline.

This is the standard DML head of Roth et al. 2020 (and N-grouping in A-grouping's
Table 3, "Emb: 1 x 512"). Its ``project`` layer is the "embedding layer" that
DIML applies at every spatial location for its local embeddings.

Options: ``pool`` (``"avg"``, ``"max"`` or their sum ``"avg+max"``, the pooling of AVSL's
baseline trunk: zbr17/GeDML src/gedml/core/models/basic_models/resnet50.py lines 37-40)
and ``init``, the Linear's initialisation: ``"default"`` (PyTorch's) or
``"kaiming_normal_fan_out"`` (kaiming_normal_ with mode fan_out, zero bias: GeDML's MLP
embedder, src/gedml/core/models/basic_models/mlp.py lines 11-14).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.methods.base import HeadOutput, Method, register_method
from harness.methods.roles import Tunable

if TYPE_CHECKING:
    from optuna.trial import Trial

POOLS = ("avg", "max", "avg+max")
INITS = ("default", "kaiming_normal_fan_out")


@register_method("plain", description="global pooling + linear (no-grouping baseline)")
class PlainHead(Method, Tunable):
    """Global pooling (average, max or their sum) then a linear embedding, L2-normalised."""

    label = "Baseline"

    def __init__(self, *, channels, embedding_size, pool: str = "avg", init: str = "default"):
        super().__init__(channels=channels, embedding_size=embedding_size)
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        self.pool, self.init = pool, init
        self.project = nn.Linear(self.in_channels, embedding_size)
        if init == "kaiming_normal_fan_out":
            nn.init.kaiming_normal_(self.project.weight, mode="fan_out")
            nn.init.zeros_(self.project.bias)

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
