"""The fault-injection suite's parts (:mod:`harness.cli.faults`): a spec names a part, a
count and an action, and a wrapped checkpointer fails at its N-th save."""

from __future__ import annotations

import pytest

from harness.base.errors import HarnessError
from harness.cli.faults import Fault, FaultyCheckpointer
from harness.engine.run.checkpoints import InMemoryCheckpointer


@pytest.mark.parametrize("spec", ["train_batch:x:kill", "write:2:kill", "checkpoint:2:explode"])
def test_a_fault_spec_is_checked(spec):
    with pytest.raises(HarnessError, match="expected PART:N:ACTION"):
        Fault.parse(spec)


def test_a_checkpointer_on_a_full_disk_fails_at_its_nth_save_and_keeps_the_earlier_one():
    inner = InMemoryCheckpointer()
    checkpointer = FaultyCheckpointer(inner, Fault.parse("checkpoint:2:enospc"))
    checkpointer.save({"epoch": 1})
    with pytest.raises(HarnessError, match="cannot write last.pt: No space left on device"):
        checkpointer.save({"epoch": 2})
    assert checkpointer.load() == {"epoch": 1}
    checkpointer.save({"epoch": 2})  # only the N-th save fails
    assert [c["epoch"] for c in inner.saved] == [1, 2]
