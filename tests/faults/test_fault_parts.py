"""The fault-injection suite's parts (:mod:`harness.cli.faults`): a spec names a part, a
count and an action; a wrapped checkpointer fails at its N-th save, the wrapped atomic
writer at the N-th write of a named file."""

from __future__ import annotations

import pytest

from harness.base import atomic
from harness.base.errors import HarnessError
from harness.cli.faults import Fault, FaultyCheckpointer, fault_train
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


def test_a_write_fault_wraps_the_atomic_writer_for_the_files_it_names(tmp_path, monkeypatch):
    """``write:*.md:2:enospc``: the second Markdown file written fails as on a full disk,
    one line naming it, its earlier content kept and no temporary file left; other files
    are not counted."""
    monkeypatch.setattr(atomic, "sync_to_disk", atomic.sync_to_disk)  # restored afterwards
    assert fault_train("write:*.md:2:enospc") is None  # nothing to train differently
    table, record = tmp_path / "t.md", tmp_path / "out.json"
    atomic.atomic_write_text(table, "first\n")
    atomic.atomic_write_json(record, {"n": 1})
    with pytest.raises(HarnessError, match=f"cannot write {table}: No space left on device"):
        atomic.atomic_write_text(table, "second\n")
    assert table.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "t.md"]
    atomic.atomic_write_text(table, "third\n")  # only the N-th write fails
    assert table.read_text() == "third\n"
