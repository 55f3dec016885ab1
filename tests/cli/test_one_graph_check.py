"""``run --cuda-graphs`` names what keeps a method's step from being one graph before any
run starts (on a machine without a GPU the device check comes first, so the check is
called here directly, as ``run`` calls it for each method)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.base.errors import HarnessError
from harness.cli.run import _check_one_graph
from harness.config.protocol_files import load_protocol
from harness.methods import check_method_options
from tests.conftest import TINY_PROTOCOL


def _check(method: str, miner: str, **options) -> None:
    protocol = load_protocol(TINY_PROTOCOL)
    protocol = dataclasses.replace(protocol, miner=dataclasses.replace(protocol.miner, name=miner))
    head = check_method_options(method, options, embedding_size=protocol.embedding.size)
    _check_one_graph(method, head, protocol, protocol.loss.name, torch.device("cpu"))


def test_a_fixed_shape_step_passes():
    _check("plain", "distance_weighted_fixed")
    _check("sam_quadruplet", "hard_negative")


@pytest.mark.parametrize(
    "method,miner,options,reason",
    [
        (
            "plain",
            "distance_weighted",
            {},
            "--cuda-graphs needs plain's step as one graph, but "
            "miner DistanceWeightedMiner returns index lists",
        ),
        (
            "sam",
            "distance_weighted_fixed",
            {"selection": "host"},
            "--cuda-graphs needs sam's "
            "step as one graph, but the method works on the host by design",
        ),
    ],
)
def test_what_breaks_the_graph_is_one_line(method, miner, options, reason):
    with pytest.raises(HarnessError) as refused:
        _check(method, miner, **options)
    assert str(refused.value).startswith(reason)
    assert "\n" not in str(refused.value)
