"""The fingerprints of the shipped protocols are pinned: a refactor, a new optional key or a
documentation table (``[deviations]``) must leave them as they are. A change that alters
what a protocol computes changes its fingerprint on purpose: update the value here in the
same commit, and say why in its message."""

from __future__ import annotations

import pytest

from harness.config.catalog import list_protocols
from harness.config.fingerprint import fingerprint
from harness.config.protocol_files import load_protocol

#: fingerprint(protocol on cub200, split digest "digest", its default loss and arguments)
PINNED = {
    "agrouping": "209fc7e8b8fbaf72",
    "agrouping-googlenet": "93caab4d35573db4",
    "agrouping-sec42": "54b67a2242cad3b9",
    "avsl": "cfd8724dde0cadf1",
    "diablo": "b90bc2713f70adf2",
    "diablo-ablation": "3b058c9e5f6d4808",
    "diablo-smoke": "d1a49ab4fcb203e6",
    "diml": "02c0c335311ec63c",
    "explain": "de8bbad61635a962",
    "roth2020": "da7856d2b54f2029",
    "sam": "46f05f1f9e8419e7",
    "smoke": "29647569af4d78fb",
}


def test_every_shipped_protocol_is_pinned():
    assert sorted(PINNED) == list_protocols()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_shipped_protocol_keeps_its_fingerprint(name):
    protocol = load_protocol(name).for_dataset("cub200")
    loss = protocol.loss.name
    assert (
        fingerprint(protocol, "digest", loss=loss, loss_args=protocol.loss_args(loss))
        == PINNED[name]
    )
