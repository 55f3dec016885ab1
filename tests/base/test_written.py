"""harness.base.written: the record of what the harness wrote tells its own outputs from a
user's file, whatever the file holds; it moves with its folder; a write that fails part
way leaves the earlier outputs and the record consistent."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from harness.base import atomic
from harness.base.errors import HarnessError
from harness.base.written import (
    RECORD_NAME,
    foreign_files,
    provenance,
    write_output_json,
    write_outputs,
)

TABLE = "| method | R@1 |\n|:---|:---:|\n| plain | 50.0 |\n"


def test_a_file_is_absent_unchanged_changed_or_foreign(tmp_path):
    table = tmp_path / "t.md"
    assert provenance(table) == "absent"
    write_outputs({table: TABLE})
    assert provenance(table) == "unchanged"
    table.write_text(TABLE + "| mine | 1.0 |\n")
    assert provenance(table) == "changed"
    user = tmp_path / "README.md"
    user.write_text(TABLE)  # a table, typed by hand: content says nothing of who wrote it
    assert provenance(user) == "foreign"
    assert foreign_files(tmp_path) == [user]


def test_writing_over_a_foreign_file_is_refused_and_leaves_it(tmp_path):
    user = tmp_path / "paper.tex"
    user.write_text("\\begin{table}\nmine\n\\end{table}\n")
    before = user.read_bytes()
    with pytest.raises(HarnessError, match="the harness did not write it"):
        write_outputs({tmp_path / "new.md": TABLE, user: "replaced"})
    assert user.read_bytes() == before
    assert not (tmp_path / "new.md").exists()


def test_the_record_moves_with_its_folder(tmp_path):
    write_output_json(tmp_path / "a" / "r.json", {"x": 1.0})
    shutil.move(tmp_path / "a", tmp_path / "b")
    assert provenance(tmp_path / "b" / "r.json") == "unchanged"
    record = json.loads((tmp_path / "b" / RECORD_NAME).read_text())
    assert list(record["files"]) == ["r.json"]


def full_disk_at(name: str, sync_to_disk):
    """The atomic writer's step before a rename, failing as a full disk for the file ``name``."""

    def sync(fh, path) -> None:
        sync_to_disk(fh, path)
        if path.name == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return sync


def test_a_set_that_fails_midway_keeps_the_earlier_outputs_as_the_harness_s(tmp_path, monkeypatch):
    """A full disk while the second file of a set is written: both targets keep their
    earlier content, which the record still names."""
    first, second = tmp_path / "t.md", tmp_path / "t.tex"
    write_outputs({first: "old md", second: "old tex"})
    # the atomic writer's one seam (as the fault-injection suite wraps it): a full disk at t.tex
    monkeypatch.setattr(atomic, "sync_to_disk", full_disk_at("t.tex", atomic.sync_to_disk))
    with pytest.raises(HarnessError, match="cannot write"):
        write_outputs({first: "new md", second: "new tex"})
    monkeypatch.undo()
    assert (first.read_text(), second.read_text()) == ("old md", "old tex")
    assert provenance(first) == provenance(second) == "unchanged"
    write_outputs({first: "new md", second: "new tex"})
    assert provenance(first) == "unchanged"
    assert first.read_text() == "new md"
