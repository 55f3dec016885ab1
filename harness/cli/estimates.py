"""The estimate ``run`` and ``sweep`` print before their first run
(:func:`harness.engine.run.estimate.estimate_runs`), and the ``--yes`` gate: on a CPU, a
command estimated at more than :data:`GATE_SECONDS` stops before anything is trained or
recorded, in one line that names the cost."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

from harness.base.errors import HarnessError
from harness.engine.run.estimate import Estimate, PlannedRun, duration, estimate_runs

__all__ = ["GATE_SECONDS", "EstimateFunction", "estimate_or_refuse", "refusal", "say_estimate"]

#: The longest command a CPU runs without ``--yes``.
GATE_SECONDS = 3600.0

#: What estimates a command's runs: ``(runs, device, workers=...) -> Estimate``
#: (:func:`~harness.engine.run.estimate.estimate_runs`, or a stand-in handed to ``run``).
EstimateFunction = Callable[..., Estimate]


def estimate_or_refuse(
    runs: Sequence[PlannedRun],
    device: torch.device,
    *,
    workers: int | None,
    yes: bool,
    estimate: EstimateFunction = estimate_runs,
) -> Estimate:
    """The estimate of ``runs`` (by ``estimate``); on a CPU, one over :data:`GATE_SECONDS`
    without ``yes`` is a :class:`~harness.base.errors.HarnessError` of one line."""
    gated = device.type == "cpu" and not yes
    found = estimate(runs, device, workers=workers, stop_over=GATE_SECONDS if gated else None)
    if gated and found.seconds > GATE_SECONDS:
        raise HarnessError(refusal(found))
    return found


def refusal(estimate: Estimate) -> str:
    """The gate's line: the estimate, its costliest part, and the ways on."""
    method, part = estimate.costliest()
    text = (
        f"estimated {estimate.amount().removeprefix('about ')} on {estimate.device} "
        f"for {estimate.counted()}, most of it {part.what} ({duration(part.seconds)}); "
        f"pass --yes to run it anyway"
    )
    if part.kind == "ranking" and method.top_k_setting:
        text += f", or {method.top_k_setting}"
    return text


def say_estimate(estimate: Estimate, *, note: str = "") -> None:
    """The estimate's two lines on stderr (``note`` ends the first); none where no run
    was counted (each failed its warm-up, and the run itself says why, in one line)."""
    if not estimate.methods:
        return
    print(estimate.line() + note, file=sys.stderr)
    print(estimate.breakdown(), file=sys.stderr, flush=True)
