"""The fingerprint: one hash of what makes two runs' numbers comparable (the canonical
protocol, the resolved loss, the dataset split and the number of processes)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from harness.config.overrides import jsonable
from harness.config.protocol import UNCOUNTED_KEYS, Protocol

__all__ = ["fingerprint"]


def fingerprint(
    protocol: Protocol,
    split_digest: str,
    *,
    loss: str = "",
    loss_args: Any = None,
    world_size: int = 1,
) -> str:
    """Hash of the canonical protocol, the resolved loss and the dataset split (16 hex chars).

    ``world_size``: processes that trained the run together (``torchrun``). The global
    batch is the protocol's either way, but the arithmetic differs (gathered embeddings,
    averaged gradients), so runs with other world sizes are not put side by side in one
    table. Absent from the payload at 1, so single-process fingerprints are unchanged.

    The keys that change no number (:data:`~harness.config.protocol.UNCOUNTED_KEYS`) are
    left out: the ``[training]`` section (:class:`~harness.config.sections.TrainingSpec`),
    which says how often the loop reads the device, and ``evaluation.examples`` and
    ``evaluation.map_points``, what the run's figures show."""
    canonical = protocol.to_dict()
    for key in UNCOUNTED_KEYS:
        section, _, name = key.partition(".")
        if name:
            canonical.get(section, {}).pop(name, None)
        else:
            canonical.pop(section, None)
    payload = json.dumps(
        {
            "protocol": canonical,
            "split": split_digest,
            "loss": loss,
            "loss_args": jsonable(loss_args or {}),
            **({"world_size": int(world_size)} if world_size != 1 else {}),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
