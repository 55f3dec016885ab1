"""``run --cuda-graphs`` names what keeps a method's step from being one graph before any
run starts. The reason is the engine's (:func:`~harness.engine.run.compiled_step.whole_graph_blocker`
over the method's head and the miner the run would use), checked here on the CPU for each
method as ``run`` checks it; the command's own line, which needs a GPU to get past the device
check, is checked where there is one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.base.device import amp_dtype
from harness.cli.main import main
from harness.config.protocol_files import load_protocol
from harness.engine.run.compiled_step import whole_graph_blocker
from harness.engine.run.step import run_miner
from harness.methods import check_method_options
from tests.conftest import TINY_PROTOCOL


def _blocker(method: str, miner: str, **options) -> str:
    protocol = load_protocol(TINY_PROTOCOL)
    protocol = dataclasses.replace(protocol, miner=dataclasses.replace(protocol.miner, name=miner))
    head = check_method_options(method, options, embedding_size=protocol.embedding.size)
    dtype = amp_dtype(torch.device("cpu"), protocol.numerics.precision)
    return whole_graph_blocker(head, run_miner(protocol.loss.name, protocol), dtype)


def test_a_fixed_shape_step_passes():
    assert _blocker("plain", "distance_weighted_fixed") == ""
    assert _blocker("sam_quadruplet", "hard_negative") == ""


@pytest.mark.parametrize(
    "method,miner,options,reason",
    [
        ("plain", "distance_weighted", {}, "miner DistanceWeightedMiner returns index lists"),
        (
            "sam",
            "distance_weighted_fixed",
            {"selection": "host"},
            "the method works on the host by design",
        ),
    ],
)
def test_what_breaks_the_graph_is_one_line(method, miner, options, reason):
    blocker = _blocker(method, miner, **options)
    assert blocker.startswith(reason)
    assert "\n" not in blocker


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--cuda-graphs runs on a GPU only")
def test_run_refuses_a_step_that_is_not_one_graph_before_any_run(workdir, capsys):
    argv = ["run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL), "--device", "cuda"]
    miner = ["--set", 'miner.name="distance_weighted"', "--cuda-graphs"]
    assert main([*argv, *miner]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "error: --cuda-graphs needs plain's step as one graph, but miner DistanceWeightedMiner "
        "returns index lists"
    )
