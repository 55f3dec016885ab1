"""Gradient handling between the backward pass and the optimizer step.

:func:`clip_gradients` is the protocol's ``optimizer.clip_grad_norm``: each optimizer
parameter group clipped on its own to a total L2 norm, as GeDML's trainer clips each
module it trains (``gradclipper`` per trunk, embedder, collector and loss, max_norm 10 in
AVSL's configurations: zbr17/GeDML src/gedml/launcher/misc/utils.py lines 14-20,
src/gedml/launcher/trainers/base_trainer.py lines 320-328; zbr17/AVSL
examples/config/param/gradclipper/gradclipper_models.yaml line 3). The harness's groups
are those parts: backbone (trunk), head (embedder), a head's own groups (AVSL's
collector) and loss. Groups that carry the same ``"clip"`` name are one unit, clipped
together: a part the code clips as one that the optimizer holds in several groups (AVSL's
collector, whose alpha, beta and proxies train in two groups).
"""

from __future__ import annotations

import torch

__all__ = ["clip_gradients", "clip_units", "clips_at"]


def clips_at(clip_steps: str, epoch: int, step: int) -> bool:
    """Whether step ``step`` of epoch ``epoch`` (both from 0) clips under the protocol's
    ``optimizer.clip_steps``: ``every`` step, or the run's ``first`` alone (GeDML's clipper
    clips only its first call: it hands ``clip_grad_norm_`` the same exhausted generator of
    parameters at every later one)."""
    return clip_steps == "every" or (epoch, step) == (0, 0)


def clip_gradients(
    optimizer: torch.optim.Optimizer, max_norm: float, scaler: torch.amp.GradScaler | None = None
) -> None:
    """Clip the gradients of each clipping unit of ``optimizer`` (:func:`clip_units`) to
    total norm ``max_norm`` (nothing when it is 0). A float16 loss scaler's scale is taken
    out first, so the norm is the true gradient's. Queues device work only (no host read)."""
    if max_norm <= 0:
        return
    if scaler is not None and scaler.is_enabled():
        scaler.unscale_(optimizer)
    for unit in clip_units(optimizer):
        params = [p for p in unit if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_norm_(params, max_norm)


def clip_units(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """The parameters clipped together, in group order: each group on its own, except that
    the groups sharing a ``"clip"`` name form one unit (at the place of the first)."""
    units: list[list[torch.Tensor]] = []
    named: dict[str, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        name = group.get("clip")
        if name is None:
            units.append(list(group["params"]))
        elif name in named:
            named[name].extend(group["params"])
        else:
            named[name] = list(group["params"])
            units.append(named[name])
    return units
