"""``benchmarks/bench_scale.py`` runs every stage on a tiny stand-in and writes its JSON and
figure; the stand-ins have the official layouts and the scaled counts, as the loaders read
them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.components.data import DATASETS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_scale.py"
sys.path.insert(0, str(SCRIPT.parent))
import stand_ins  # noqa: E402  (a script's sibling module, not a package)


def test_the_full_fraction_has_the_official_counts():
    for dataset, (train, test) in stand_ins.OFFICIAL.items():
        assert stand_ins.scaled_counts(dataset, 1.0) == (train, test)


@pytest.mark.parametrize("dataset", sorted(stand_ins.OFFICIAL))
def test_a_stand_in_reads_back_with_its_counts(dataset, tmp_path):
    root, counts, written = stand_ins.stand_in(dataset, 0.002, tmp_path)
    splits = DATASETS.get(dataset).load(root)
    train, test = counts["train"], counts["test"]
    assert (len(splits.train), len(np.unique(splits.train.labels))) == (
        train["images"],
        train["classes"],
    )
    assert (len(splits.test), len(np.unique(splits.test.labels))) == (
        test["images"],
        test["classes"],
    )
    assert len(splits.gallery or ()) == test["gallery"]
    assert written
    assert stand_ins.stand_in(dataset, 0.002, tmp_path)[2] is False  # reused


@pytest.mark.slow  # 15 s on 2 cores: the whole script at two tiny fractions
def test_the_script_times_every_stage_at_each_fraction(tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable,
        str(SCRIPT),
        "--dataset",
        "cub200",
        "--fraction",
        "0.01,0.02",
        "--cache",
        str(tmp_path / "cache"),
        "--batches",
        "2",
        "--embed-images",
        "32",
        "--out",
        str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((out / "scale.json").read_text())
    stages = [
        "verify",
        "splits",
        "sampler",
        "loader",
        "embed",
        "evaluate",
        "record",
        "chance",
        "table",
    ]
    assert result["stages"] == stages
    assert [f["fraction"] for f in result["fractions"]] == [0.01, 0.02]
    for fraction in result["fractions"]:
        assert set(fraction["stages"]) == set(stages)
        assert all(s["seconds"] > 0 and s["peak_rss_mb"] > 0 for s in fraction["stages"].values())
    assert set(result["exponents"]) == set(stages)
    assert (out / "scale.png").stat().st_size > 0
