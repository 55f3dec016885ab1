"""A checkpoint cut short at any byte is refused in one line and the run restarts from
scratch (never from garbage), ending with the metrics of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from harness.cli.main import main


def run_cli(*args: str) -> int:
    return main(["run", *args])


def _records(path: Path) -> list[dict]:
    return json.loads(path.read_text())


# ------------------------------------------------------------------------ checkpoints


def _checkpoint(epoch: int) -> dict:
    model = torch.nn.Linear(4, 2)
    return {
        "epoch": epoch,
        "model": model.state_dict(),
        "loss": {},
        "optimizer": {},
        "scheduler": {},
        "history": [{"epoch": epoch}],
        "best": {"epoch": epoch, "score": 0.5, "state": None},
    }


def test_a_truncated_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    from harness.engine.run.checkpoints import CheckpointFile

    path = tmp_path / "last.pt"
    digest = CheckpointFile(path).save(_checkpoint(1))
    file = CheckpointFile(path)
    assert file.load()["epoch"] == 1 and file.digest == digest
    whole = path.read_bytes()
    rng = random.Random(17)  # seeded: the same offsets every run
    cuts = sorted(
        {
            0,
            1,
            100,
            len(whole) // 2,
            len(whole) - 1,
            *(rng.randrange(len(whole)) for _ in range(12)),
        }
    )
    for cut in cuts:
        for with_sidecar in (True, False):  # without: a checkpoint of an older harness
            path.write_bytes(whole[:cut])
            if not with_sidecar:
                file.checksum_path.unlink(missing_ok=True)
            capsys.readouterr()
            assert file.load() is None and file.digest is None, cut
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"checkpoint {path} is unreadable (")
            assert lines[0].endswith("); starting from scratch")
            CheckpointFile(path).save(_checkpoint(1))  # the sidecar again


def test_a_checkpoint_with_any_byte_changed_is_refused(tmp_path, capsys):
    """Same length, one byte flipped anywhere (a bad sector, a copy gone wrong): the sha256
    sidecar refuses it, where torch.load alone may read garbage tensors without complaint."""
    from harness.engine.run.checkpoints import CheckpointFile

    path = tmp_path / "last.pt"
    CheckpointFile(path).save(_checkpoint(1))
    whole = path.read_bytes()
    rng = random.Random(23)
    for at in sorted({0, len(whole) - 1, *(rng.randrange(len(whole)) for _ in range(12))}):
        data = bytearray(whole)
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
        capsys.readouterr()
        assert CheckpointFile(path).load() is None, at
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert (
            line.startswith(f"checkpoint {path} is unreadable (")
            and "not a digest recorded" in line
        )
    path.write_bytes(whole)
    assert CheckpointFile(path).load()["epoch"] == 1


def test_a_crash_between_the_sidecar_and_the_rename_keeps_the_old_checkpoint_valid(
    tmp_path, monkeypatch
):
    from harness.engine.run.checkpoints import CheckpointFile

    path = tmp_path / "last.pt"
    file = CheckpointFile(path)
    first = file.save(_checkpoint(1))
    real_replace = os.replace

    def crash(src, dst):
        if Path(dst) == path:
            raise KeyboardInterrupt  # killed after the sidecar was rewritten
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        file.save(_checkpoint(2))
    monkeypatch.setattr(os, "replace", real_replace)
    assert file.digest == first  # the file under the name is still the first
    reread = CheckpointFile(path)
    assert reread.load()["epoch"] == 1 and reread.digest == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "last.pt.sha256.json"]


def test_resume_from_a_truncated_checkpoint_restarts_and_ends_with_the_uninterrupted_metrics(
    workdir, tiny_protocol, capsys
):
    from harness.engine.run.checkpoints import CheckpointFile

    common = ("--methods", "plain", "--protocol", str(tiny_protocol))
    reference, resumed = workdir / "ref.json", workdir / "resumed.json"
    assert run_cli(*common, "--json", str(reference)) == 0
    (checkpoint,) = workdir.glob("results/checkpoints/*/last.pt")
    whole = checkpoint.read_bytes()
    for cut in (0, 1, 4096, len(whole) // 2, len(whole) - 1):  # a real checkpoint, cut anywhere
        checkpoint.write_bytes(whole[:cut])
        assert CheckpointFile(checkpoint).load() is None
    checkpoint.write_bytes(whole[:-1])
    capsys.readouterr()
    assert run_cli(*common, "--resume", "--json", str(resumed)) == 0
    err = capsys.readouterr().err
    refused = [line for line in err.splitlines() if "is unreadable" in line]
    assert len(refused) == 1 and refused[0].endswith("starting from scratch")
    assert refused[0].startswith(f"checkpoint {checkpoint.relative_to(workdir)} is unreadable (")
    assert "resuming" not in err and "Traceback" not in err
    assert _records(resumed)[0]["metrics"] == _records(reference)[0]["metrics"]
    assert CheckpointFile(checkpoint).load()["epoch"] == 2  # rewritten whole
