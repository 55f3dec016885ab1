"""The training step under ``run --compile``: forward, loss and backward captured whole.

``torch.compile`` captures a function as one graph only where nothing in it needs the
host: no value read back, no shape that depends on the data, no Python the compiler
cannot follow. A training step meets that when its miner works in a fixed shape
(:class:`~harness.components.losses.miners.FixedShapeMiner`, or no miner) and its method
declares no host work (:class:`~harness.methods.roles.HostReader`). Then its
forward, loss terms and backward compile with ``fullgraph=True``: one graph, replayed every
step, and with ``--cuda-graphs`` (inductor's ``reduce-overhead`` mode) as a CUDA graph.

The optimizer step (gradient clipping per group, the update) is a second compiled
function: PyTorch's optimizers break the graph around their update on purpose
(``torch/optim/optimizer.py``, ``_use_grad``: the update must run without autograd), so
it cannot share the backward's graph.

Elsewhere (an indexed miner, SAM's selection on the host) the forward and loss compile
with graph breaks where the host is needed, the backward runs eagerly after them (Dynamo
traces a backward only inside a whole graph), and the run says why in one line.

Random draws inside the graph (the miner's, dropout) come from torch's global generator,
seeded before each step from ``(seed, epoch, step)`` (:func:`~harness.components.losses.step_seed`):
the step's draws depend on nothing else, as in eager training. Eager training seeds each
mining call apart, with the same seed for a step's first: a method that mines once a
step draws the same tuples either way; one that mines per group or level, or uses
dropout, draws others, and inductor draws its own random numbers in any case, so a
compiled run has its own numbers for a seed, recorded with the ``compile`` tag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.utils import counters

from harness.base.errors import HarnessError
from harness.components.losses import FixedShapeMiner
from harness.engine.run.runtime import log_line
from harness.methods.roles import HostReader

__all__ = [
    "CompiledStep",
    "whole_graph_blocker",
    "compile_step",
    "forward_then_backward",
    "said_if_not_replayed",
]


@dataclass(frozen=True)
class CompiledStep:
    """The compiled halves of a training step, and whether the first is one whole graph."""

    forward_backward: Callable[..., Any]
    optimizer_step: Callable[[], None]
    fullgraph: bool
    #: Why the step has graph breaks ("" where it has none).
    breaks_because: str = ""


def whole_graph_blocker(head: Any, miner: Any, dtype: torch.dtype | None = None) -> str:
    """Why a step with ``head``, ``miner`` and autocast ``dtype`` cannot be one graph, or ""
    where it can."""
    if dtype == torch.float16:
        return "float16's loss scaler (torch.amp.GradScaler) is not traced by torch.compile"
    if miner is not None and not isinstance(miner, FixedShapeMiner):
        return (
            f"miner {type(miner).__name__} returns index lists whose length depends on the "
            f"data (a fixed-shape miner: distance_weighted_fixed, distance_weighted_roth, "
            f"hard_negative, multi_similarity)"
        )
    host = head.step_host_reads() if isinstance(head, HostReader) else ""
    if host:
        return f"the method works on the host by design: {host}"
    return ""


def compile_step(
    forward_loss: Callable[..., Any],
    backward: Callable[[torch.Tensor], None],
    optimizer_step: Callable[[], None],
    *,
    head: Any,
    miner: Any,
    device: torch.device,
    dtype: torch.dtype | None = None,
    cuda_graphs: bool = False,
    backend: Any = "inductor",
    optimizer_backend: Any = None,
) -> CompiledStep:
    """The step's forward, loss and ``backward`` compiled as one graph where
    :func:`whole_graph_blocker` finds nothing in the way; elsewhere ``forward_loss`` compiled
    with graph breaks and the backward run eagerly after it (Dynamo's traced backward needs
    the whole graph). ``optimizer_step`` is compiled on its own. ``cuda_graphs``: replay the
    whole graph as a CUDA graph (a CUDA device only). ``backend``: torch.compile's
    (``optimizer_backend`` for the optimizer step, default the same)."""
    blocker = whole_graph_blocker(head, miner, dtype)
    if cuda_graphs and device.type != "cuda":
        raise HarnessError(
            f"--cuda-graphs replays the compiled step on a GPU; the run's device is {device.type}"
        )
    if cuda_graphs and blocker:
        raise HarnessError(f"--cuda-graphs needs the step as one graph, but {blocker}")

    def then_backward(forward: Callable[..., Any]) -> Callable[..., Any]:
        return lambda images, labels: forward_then_backward(forward, backward, images, labels)

    optimizer = torch.compile(optimizer_step, backend=optimizer_backend or backend)
    if blocker:
        compiled_forward = torch.compile(forward_loss, backend=backend)
        return CompiledStep(then_backward(compiled_forward), optimizer, False, blocker)
    # The backward inside the captured function (Dynamo traces Tensor.backward only so).
    torch._dynamo.config.trace_autograd_ops = True
    options: dict[str, Any] = {"mode": "reduce-overhead"} if cuda_graphs else {}
    whole = torch.compile(then_backward(forward_loss), fullgraph=True, backend=backend, **options)
    return CompiledStep(said_if_not_replayed(whole) if cuda_graphs else whole, optimizer, True)


def forward_then_backward(
    forward: Callable[..., Any], backward: Callable[[torch.Tensor], None], images, labels
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``forward(images, labels)`` (the loss and its terms), then ``backward(loss)``; returns
    the loss and its terms, detached: a training step's first half, eager or compiled."""
    loss, terms = forward(images, labels)
    backward(loss)
    return loss.detach(), {name: value.detach() for name, value in terms.items()}


def said_if_not_replayed(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` saying once, in one line, when inductor compiles it without the CUDA graph
    asked for (its ``cudagraph_skips`` counter grows: a reason in inductor's own warning),
    so a run tagged ``cuda_graphs`` that does not replay one says so."""

    said = False

    def replayed(images, labels):
        nonlocal said
        before = counters["inductor"]["cudagraph_skips"]
        out = step(images, labels)
        if not said and counters["inductor"]["cudagraph_skips"] > before:
            said = True
            log_line(
                "cuda-graphs: inductor compiled the step without a CUDA graph (inductor's log "
                "says why: TORCH_LOGS=cudagraphs); it runs compiled, not replayed"
            )
        return out

    return replayed
