"""``Registry.temporarily``: a plugin registered for one test is there inside the block and
gone after it, however the block ends; its name is checked as ``register`` checks one."""

from __future__ import annotations

import pytest

from harness.base.registry import BadName, NameTaken, Registry


def _things() -> Registry[str]:
    things: Registry[str] = Registry(
        "thing", name_rule=lambda name: "is reserved" if name == "all" else None
    )
    things.register("kept")("k")
    return things


def test_an_entry_registered_for_a_block_is_removed_after_it():
    things = _things()
    with things.temporarily("brief", "b") as entry:
        assert entry == "b" and things.get("brief") == "b"
        assert things.list() == ["brief", "kept"]
    assert "brief" not in things and things.list() == ["kept"]


def test_the_entry_is_removed_when_the_block_fails():
    things = _things()
    with pytest.raises(RuntimeError, match="the test failed"), things.temporarily("brief", "b"):
        raise RuntimeError("the test failed")
    assert things.list() == ["kept"]


def test_a_taken_or_refused_name_is_refused_and_leaves_the_registry_as_it_was():
    things = _things()
    with pytest.raises(NameTaken), things.temporarily("kept", "again"):
        pass
    with (
        pytest.raises(BadName, match="thing name 'all' is reserved"),
        things.temporarily("all", "a"),
    ):
        pass
    assert things.list() == ["kept"] and things.get("kept") == "k"
