"""harness.base.atomic: a writer failing mid-way leaves neither the target nor a temporary
file; two writers of one file do not collide; data and rename are fsynced."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from harness.base.atomic import atomic_save_torch, atomic_write, atomic_write_bytes, sha256_file


def test_a_writer_failing_midway_leaves_neither_the_target_nor_a_temporary_file(tmp_path):
    target = tmp_path / "out" / "result.json"

    def half_then_fail(fh):
        fh.write(b'{"half": ')
        raise OSError("disk full")

    from harness.base.errors import HarnessError

    with pytest.raises(
        HarnessError, match=r"cannot write .*result.json: disk full"
    ):  # one line, naming it
        atomic_write(target, half_then_fail)
    assert list(target.parent.iterdir()) == []

    target.write_bytes(b"old")  # an existing target keeps its content
    for error in (RuntimeError("boom"), KeyboardInterrupt()):

        def fail(fh, error=error):
            fh.write(b"new, cut short")
            raise error

        with pytest.raises(type(error)):
            atomic_write(target, fail)
        assert target.read_bytes() == b"old"
        assert [p.name for p in target.parent.iterdir()] == ["result.json"]


def test_two_concurrent_writers_of_one_file_do_not_collide(tmp_path):
    """The old helpers wrote every writer's data to one fixed temporary name."""
    target = tmp_path / "last.pt"
    payloads = [bytes([i]) * (1 << 20) for i in (1, 2)]
    errors: list[BaseException] = []

    def writer(data: bytes) -> None:
        try:
            for _ in range(25):
                atomic_write_bytes(target, data)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert target.read_bytes() in payloads  # whole, one writer's
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_atomic_writes_are_fsynced_and_keep_the_usual_permissions(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    digest = atomic_save_torch({"w": torch.ones(3)}, tmp_path / "model.pt")
    assert len(synced) >= 1  # the file (and the folder where the platform allows)
    assert digest == sha256_file(tmp_path / "model.pt")
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "model.pt").stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_the_old_file(tmp_path):
    """A write the disk refuses half-way (``ENOSPC`` from the writer it is handed) is one
    HarnessError naming the file, the previous version intact, no temporary file left."""
    import errno

    from harness.base.atomic import atomic_write_text
    from harness.base.errors import HarnessError

    def full_disk(fh) -> None:
        fh.write("new\n" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    target = tmp_path / "table.md"
    atomic_write_text(target, "old\n")
    with pytest.raises(HarnessError) as caught:
        atomic_write(target, full_disk, binary=False)
    message = str(caught.value)
    assert (
        message.startswith(f"cannot write {target}: No space left on device")
        and "\n" not in message
    )
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "table.md"
    ]
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n"


def test_the_temporary_file_of_a_killed_writer_is_removed_by_the_next_writer(tmp_path):
    """A SIGKILL mid-write leaves the writer's temporary file (nothing can remove it then);
    the next write of the same target on this host removes it once its process is gone,
    and leaves those of live writers, other hosts and other targets alone."""
    import subprocess
    import sys

    from harness.base.atomic import writer_tag

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = tmp_path / "last.pt"
    orphan = tmp_path / f".last.pt.{writer_tag(dead.pid)}.k3j2h1.tmp"
    live = tmp_path / f".last.pt.{writer_tag(os.getppid())}.a1b2c3.tmp"
    elsewhere = tmp_path / f".last.pt.otherhost-{dead.pid}.x9y8z7.tmp"
    other_target = tmp_path / f".last.pt.json.{writer_tag(dead.pid)}.q1w2e3.tmp"
    for path in (orphan, live, elsewhere, other_target):
        path.write_bytes(b"half a checkpoint")
    atomic_write_bytes(target, b"whole")
    assert target.read_bytes() == b"whole"
    assert not orphan.exists()
    assert live.exists() and elsewhere.exists() and other_target.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp") == sorted(
        p.name for p in (live, elsewhere, other_target)
    )


def test_a_name_of_the_longest_length_is_written_and_replaced(tmp_path):
    """A target whose name takes all of NAME_MAX bytes is written and replaced atomically
    (its temporary files take a shortened name), leaving no temporary file."""
    from harness.base.atomic import atomic_write_set
    from harness.base.paths import NAME_MAX

    target = tmp_path / ("\u00e9" * 124 + "xy.json")
    assert len(os.fsencode(target.name)) == NAME_MAX
    atomic_write_bytes(target, b"first")
    atomic_write_set({target: b"second", tmp_path / "t.md": "table"})
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, "t.md"])


def test_the_writer_never_replaces_a_special_file_or_a_database(tmp_path):
    """``os.replace`` would put the new file where a FIFO, a folder or a database was: each
    is one error line, and the thing at the path is left as it was."""
    import sqlite3
    import stat

    from harness.base.errors import HarnessError

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(
        HarnessError, match=r"pipe: it is a FIFO, not a regular file; nothing written"
    ):
        atomic_write_bytes(fifo, b"{}")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)

    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(HarnessError, match="it is a folder"):
        atomic_write_bytes(folder, b"{}")

    database = tmp_path / "store.db"
    connection = sqlite3.connect(database)
    connection.execute("CREATE TABLE runs (id TEXT)")
    connection.commit()
    connection.close()
    before = database.read_bytes()
    with pytest.raises(HarnessError, match="it is an SQLite database"):
        atomic_write_bytes(database, b"{}")
    assert database.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "pipe", "store.db"]


def test_output_paths_refuse_the_store_and_special_files(tmp_path):
    """``writable_file`` / ``writable_folder`` against reserved places: the database (with
    SQLite's companion files) and everything under an artifact folder."""
    from harness.base.errors import HarnessError
    from harness.base.paths import ReservedPath, writable_file, writable_folder

    store = (
        ReservedPath(tmp_path / "mlflow.db", "the store's database"),
        ReservedPath(tmp_path / "mlartifacts", "the store's artifacts", folder=True),
    )
    for name in ("mlflow.db", "mlflow.db-wal", "mlflow.db-journal"):
        with pytest.raises(HarnessError, match=f"--json .*{name} is the store's database"):
            writable_file(tmp_path / name, "--json", reserved=store)
    with pytest.raises(HarnessError, match="is inside the store's artifacts"):
        writable_file(tmp_path / "mlartifacts" / "1" / "a.json", "--json", reserved=store)
    with pytest.raises(
        HarnessError, match="--out .* is inside the store's artifacts; give a folder outside"
    ):
        writable_folder(tmp_path / "mlartifacts" / "x", "--out", reserved=store)
    # Beside the store is fine: a name that merely starts like the database's, another folder.
    assert writable_file(tmp_path / "mlflow.db.json", "--json", reserved=store) is not None
    assert writable_folder(tmp_path / "mlartifacts-copy", "--out", reserved=store) is not None
    with pytest.raises(HarnessError, match="is a character device"):
        writable_file("/dev/null", "--json")
    assert list(tmp_path.iterdir()) == []
