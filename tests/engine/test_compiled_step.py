"""``run --compile`` captures a training step whole: for every method (SAM with its
default fixed-shape selection), forward, loss and backward trace as one graph (``fullgraph=True``: a graph
break is an error) and three steps compile it once (no recompilation), on the CPU with
Dynamo's tracing alone (the ``eager`` backend: what is captured, not how fast it runs)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from harness.base.errors import HarnessError
from harness.config.protocol_files import load_protocol
from harness.engine.run.compiled_step import compile_step, whole_graph_blocker
from harness.engine.run.data import prepare_splits
from harness.engine.run.recorder import InMemoryRecorder
from harness.engine.run.run_config import RunConfig
from harness.engine.run.trainer import Trainer
from harness.methods import list_methods
from tests.conftest import TINY_PROTOCOL

STEPS = 3
#: The default run traces the baseline (8 s on 2 cores); every other plugin, a family's
#: head and its named variants, with ``-m slow`` (DIML's training variant, the one that
#: trains modules of its own: 19 s).
DEFAULT_RUN = {"plain"}


def _device_steps() -> list:
    return [
        pytest.param(n, marks=() if n in DEFAULT_RUN else pytest.mark.slow) for n in list_methods()
    ]


@pytest.fixture(scope="module")
def protocol():
    p = load_protocol(TINY_PROTOCOL)
    return dataclasses.replace(
        p,
        sampling=dataclasses.replace(p.sampling, batches_per_epoch=STEPS),
        miner=dataclasses.replace(p.miner, name="distance_weighted_fixed"),
    )


@pytest.fixture(scope="module")
def splits(protocol):
    return prepare_splits(protocol, "synthetic", None, seed=0)


class CountingBackend:
    """A Dynamo backend that runs each captured graph as traced and counts the captures."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


def _trainer(protocol, splits, name: str, **options) -> Trainer:
    cfg = RunConfig.build(
        protocol,
        method=name,
        dataset="synthetic",
        loss="margin",
        seed=0,
        method_options=options or None,
    )
    trainer = Trainer.from_config(cfg, splits, recorder=InMemoryRecorder())
    trainer.batches.loader = list(trainer.batches.loader)
    return trainer


def _one_graph_for_three_steps(trainer: Trainer) -> None:
    miner = trainer.step.metric_loss.miner
    assert whole_graph_blocker(trainer.model.head, miner) == ""
    backend = CountingBackend()
    # PyTorch's optimizers break the graph around the update: the optimizer step apart.
    trainer.step.compile(backend=backend, optimizer_backend="eager")
    assert trainer.step.compiled.fullgraph
    before = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    summary = trainer.train_epoch(0)
    assert backend.graphs == 1  # one graph for the three steps: no break, no recompilation
    assert math.isfinite(summary["train_loss"])
    after = [p for p in trainer.model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # it trained


@pytest.mark.parametrize("name", _device_steps())
def test_the_step_is_one_graph_compiled_once(protocol, splits, name):
    torch._dynamo.reset()
    _one_graph_for_three_steps(_trainer(protocol, splits, name))


@pytest.mark.slow
@pytest.mark.parametrize("mining", ["random", "hardest"])
def test_sam_on_an_earlier_map_is_one_graph_with_its_autograd_grad(protocol, splits, mining):
    """Eq. 1 by autograd (``stage="s16"``: ``torch.autograd.grad`` with ``create_graph``
    inside the step) and either order of the fixed-shape selection: still one graph."""
    torch._dynamo.reset()
    _one_graph_for_three_steps(_trainer(protocol, splits, "sam", stage="s16", mining=mining))


@pytest.mark.parametrize("name", ["sam", "sam_quadruplet"])
def test_a_step_with_host_work_says_why_it_has_graph_breaks(protocol, splits, name):
    trainer = _trainer(protocol, splits, name, selection="host")
    reason = whole_graph_blocker(trainer.model.head, trainer.step.metric_loss.miner)
    assert reason.startswith("the method works on the host by design")


def test_an_indexed_miner_and_float16_are_named_as_what_breaks_the_graph(protocol, splits):
    from harness.components.losses import create_miner

    trainer = _trainer(protocol, splits, "plain")
    head = trainer.model.head
    assert "index lists" in whole_graph_blocker(head, create_miner("distance_weighted"))
    assert "loss scaler" in whole_graph_blocker(head, None, torch.float16)
    with pytest.raises(HarnessError, match="--cuda-graphs replays the compiled step on a GPU"):
        compile_step(
            trainer.step.forward_loss,
            trainer.step.backward,
            trainer.step.optimizer_step,
            head=head,
            miner=None,
            device=torch.device("cpu"),
            cuda_graphs=True,
        )


@pytest.mark.parametrize(
    "miner_name,method,options",
    [
        ("distance_weighted_fixed", "plain", {}),
        # the indexed miner's graph breaks: 10 s; its blocker is named in the default run
        pytest.param("distance_weighted", "plain", {}, marks=pytest.mark.slow),
        pytest.param(
            "distance_weighted_fixed", "sam", {"mining": "hardest"}, marks=pytest.mark.slow
        ),
    ],
)
def test_the_compiled_step_trains_as_the_eager_step(protocol, splits, miner_name, method, options):
    """Whole (a fixed-shape miner) or with graph breaks (PML's indexed miner, the backward
    then run eagerly): the same three steps as eager training of ``plain`` (one mining
    call a step, whose seed is the step's: the same draws), loss for loss and weight for
    weight; SAM's too, hardest first (its fixed-shape selection then draws nothing)."""
    chosen = dataclasses.replace(
        protocol, miner=dataclasses.replace(protocol.miner, name=miner_name)
    )
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        trainer = _trainer(chosen, splits, method, **options)
        if compiled:
            trainer.step.compile(backend="eager")
            assert trainer.step.compiled is not None
            assert trainer.step.compiled.fullgraph == (miner_name == "distance_weighted_fixed")
        summary = trainer.train_epoch(0)
        results.append((summary["train_loss"], [p.detach() for p in trainer.model.parameters()]))
    (eager_loss, eager_weights), (compiled_loss, compiled_weights) = results
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    for a, b in zip(compiled_weights, eager_weights, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_step_inductor_did_not_replay_says_so_once(capsys):
    """Where inductor compiles the step without the CUDA graph asked for (its skip counter
    grows), the run says so in one line, once."""
    from torch._dynamo.utils import counters

    from harness.engine.run.compiled_step import said_if_not_replayed

    def skipped_step(images, labels):
        counters["inductor"]["cudagraph_skips"] += 1
        return images

    step = said_if_not_replayed(skipped_step)
    for _ in range(3):
        step(torch.zeros(1), None)
    err = capsys.readouterr().err
    assert err.count("compiled the step without a CUDA graph") == 1
