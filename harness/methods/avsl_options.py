"""The options of :class:`harness.methods.avsl.AVSLHead` checked before anything is built:
each choice among its valid values, each number in its range. A value out of range is a
``ValueError`` naming the option, which the registry turns into one error line."""

from __future__ import annotations

from collections.abc import Sequence

from harness.methods.avsl_graph import CAM_SHIFTS, CAMS, LINK_TIES
from harness.methods.avsl_losses import CLIP_UNITS, DISTANCES, FINAL_LOSSES, LEVEL_MINERS

__all__ = ["RANKS", "CHOICES", "check_choices", "check_ranges", "checked_level_weights"]

#: How queries are ranked: every (query, gallery) pair by d^, or the cosine's top
#: ``rerank_k`` re-scored.
RANKS = ("exhaustive", "rerank")

#: The head's options that take one of a few values, in the constructor's order.
CHOICES: dict[str, tuple[str, ...]] = {
    "cam": CAMS,
    "cam_shift": CAM_SHIFTS,
    "rank": RANKS,
    "distance": DISTANCES,
    "link_ties": LINK_TIES,
    "level_miner": LEVEL_MINERS,
    "final_loss": FINAL_LOSSES,
    "clip_units": CLIP_UNITS,
}


def check_choices(*values: str) -> None:
    """The values of :data:`CHOICES`' options, in its order: each one of its valid values."""
    for (option, valid), value in zip(CHOICES.items(), values, strict=True):
        if value not in valid:
            raise ValueError(f"{option} must be one of {', '.join(valid)}; got {value!r}")


def check_ranges(momentum: float, topk: int, collector_lr: float, rank: str, rerank_k: int) -> None:
    """The numeric options within their ranges (``rerank_k`` only where it is used)."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if topk < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")
    if collector_lr < 0:
        raise ValueError(
            f"collector_lr must be >= 0 (0: lr_head x inference_lr_scale), got {collector_lr}"
        )
    if rank == "rerank" and rerank_k < 1:
        raise ValueError(f"rerank_k must be at least 1 with rank='rerank', got {rerank_k}")


def checked_level_weights(levels: int, weights: Sequence[float] | None) -> list[float]:
    """The per-level loss weights (default all 1, the paper's plain sum), one per level."""
    out = [1.0] * int(levels) if weights is None else [float(w) for w in weights]
    if len(out) != int(levels):
        raise ValueError(f"level_weights needs {levels} values, got {len(out)}")
    return out
