"""``datasets verify NAME`` decodes every image once and stamps the tree; ``run`` trusts a
stamp that matches the tree and otherwise checks every image's header first."""

from __future__ import annotations

import json
import os
import re

import pytest

from harness.base.errors import HarnessError
from harness.cli.main import main
from harness.components.data.verify import STAMP, check_images
from tests.fixtures import make_cub


def _truncate(path) -> None:
    """Keep a JPEG's header up to its start-of-scan marker and a few bytes after, drop the
    rest of the compressed data: the header reads, the pixels do not."""
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"\xff\xda") + 20])


def test_verify_stamps_a_readable_tree_and_a_change_makes_the_stamp_stale(tmp_path, capsys):
    root = make_cub(tmp_path, classes=200, per_class=1)
    assert main(["datasets", "verify", "cub200", "--data-root", str(tmp_path)]) == 0
    stamp = json.loads((root / STAMP).read_text())
    assert stamp["dataset"] == "cub200" and stamp["images"] == 200 and len(stamp["digest"]) == 64
    assert "200 images decoded, all readable" in capsys.readouterr().err

    said: list[str] = []
    check_images("cub200", tmp_path, say=said.append)
    assert said == []  # verified, unchanged: nothing to check

    touched = root / "images" / "010.Bird_10" / "Bird_10_0000.jpg"
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 1_000_000_000))
    check_images("cub200", tmp_path, say=said.append)
    assert len(said) == 1 and "200 image headers checked" in said[0]
    assert f"python -m harness datasets verify cub200 --data-root {tmp_path}" in said[0]


def test_verify_names_an_image_that_does_not_decode_and_writes_no_stamp(tmp_path, capsys):
    root = make_cub(tmp_path, classes=200, per_class=1)
    broken = root / "images" / "120.Bird_120" / "Bird_120_0000.jpg"
    _truncate(broken)
    with pytest.raises(HarnessError, match=f"corrupt image {re.escape(str(broken))}: "):
        check_images(
            "cub200", tmp_path, say=lambda line: None
        )  # no end marker: decoded, and refused
    assert (
        main(["datasets", "verify", "cub200", "--data-root", str(tmp_path), "--threads", "2"]) == 2
    )
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: corrupt image {broken}: ") and "not verified" in line
    assert not (root / STAMP).exists()


def test_run_on_an_unstamped_tree_checks_headers_and_says_how_to_verify(
    workdir, tmp_path, tiny_protocol, capsys
):
    make_cub(tmp_path, classes=200, per_class=1)
    assert (
        main(
            [
                "run",
                "--methods",
                "plain",
                "--dataset",
                "cub200",
                "--data-root",
                str(tmp_path),
                "--protocol",
                str(tiny_protocol),
                "--epochs",
                "0",
                "--set",
                'evaluation.metrics=["precision_at_1"]',
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "dataset 'cub200': 200 image headers checked, pixels not decoded" in err
    assert f"python -m harness datasets verify cub200 --data-root {tmp_path}" in err
