"""The fingerprints of the shipped protocols are pinned: a refactor, a new optional key or a
documentation table (``[deviations]``) must leave them as they are. A change that alters
what a protocol computes changes its fingerprint on purpose: update the value here in the
same commit, and say why in its message."""

from __future__ import annotations

import pytest

from harness.config.protocol import fingerprint, list_protocols, load_protocol

#: fingerprint(protocol on cub200, split digest "digest", its default loss and arguments)
PINNED = {
    "agrouping": "f78ff369f61de226",
    "agrouping-googlenet": "35db0e2acf007800",
    "agrouping-sec42": "c2d26a9c9cf8ed3b",
    "avsl": "e257b4767339c7d9",
    "diablo": "b90bc2713f70adf2",
    "diablo-ablation": "3b058c9e5f6d4808",
    "diablo-smoke": "c09c7b48c6e319c0",
    "roth2020": "da7856d2b54f2029",
    "sam": "5e5f6203c0ba8025",
    "smoke": "5c5a7bba12ff9786",
}


def test_every_shipped_protocol_is_pinned():
    assert sorted(PINNED) == list_protocols()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_shipped_protocol_keeps_its_fingerprint(name):
    protocol = load_protocol(name).for_dataset("cub200")
    loss = protocol.loss.name
    assert fingerprint(protocol, "digest", loss=loss, loss_args=protocol.loss_args(loss)) == PINNED[name]
