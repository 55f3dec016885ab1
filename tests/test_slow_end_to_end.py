"""Slow end-to-end checks of the shipped defaults (run with ``python -m pytest -m slow``).

They train for real on CPU for minutes: the README's main command on the embedded
dataset, and the Fashion-MNIST check that training helps on real data nobody here made.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from harness.cli import main
from harness.data.fashion_mnist import DEBIAN_PATH

pytestmark = pytest.mark.slow


def test_smoke_run_of_all_methods_on_the_embedded_dataset(workdir, capsys):
    out = workdir / "all.json"
    assert main(["run", "--methods", "all", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    from methods import list_methods

    assert {r["method"] for r in records} == set(list_methods(ablations=False))
    for record in records:
        assert all(0.0 <= v <= 1.0 for v in record["metrics"].values()), record
        assert mlflow.MlflowClient().get_run(record["mlflow_run_id"]).info.status == "FINISHED"
    assert "MAP@R" in capsys.readouterr().out


@pytest.mark.skipif(not (DEBIAN_PATH / "train-images-idx3-ubyte.gz").is_file(),
                    reason="Debian package dataset-fashion-mnist is not installed")
def test_training_beats_the_initial_model_on_fashion_mnist(workdir):
    before, after = workdir / "e0.json", workdir / "trained.json"
    assert main(["run", "--methods", "plain", "--dataset", "fashion-mnist", "--epochs", "0",
                 "--json", str(before)]) == 0
    assert main(["run", "--methods", "plain", "--dataset", "fashion-mnist", "--json", str(after)]) == 0
    p0 = json.loads(Path(before).read_text())[0]["metrics"]["precision_at_1"]
    p1 = json.loads(Path(after).read_text())[0]["metrics"]["precision_at_1"]
    print(f"Fashion-MNIST precision@1: initial {p0:.4f}, trained {p1:.4f}")
    assert p1 - p0 >= 0.05
