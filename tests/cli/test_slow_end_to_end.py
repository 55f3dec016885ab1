"""Slow end-to-end checks of the shipped defaults (run with ``python -m pytest -m slow``).

They train for real on CPU for minutes: the README's main command on the embedded
dataset, and the Fashion-MNIST checks that training helps on real data nobody here made.
"""

from __future__ import annotations

import json

import mlflow
import pytest

from harness.cli.main import main
from harness.components.data.fashion_mnist import DEBIAN_PATH

pytestmark = pytest.mark.slow


def test_smoke_run_of_all_methods_on_the_embedded_dataset(workdir, capsys):
    out = workdir / "all.json"
    assert main(["run", "--methods", "all", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    from harness.methods import list_methods

    assert {r["method"] for r in records} == set(list_methods(ablations=False))
    for record in records:
        assert all(0.0 <= v <= 1.0 for v in record["metrics"].values()), record
        assert mlflow.MlflowClient().get_run(record["mlflow_run_id"]).info.status == "FINISHED"
    assert "MAP@R" in capsys.readouterr().out


@pytest.fixture(scope="module")
def fashion_mnist_scores(tmp_path_factory, data_root, tracking_dir) -> dict[str, dict[str, float]]:
    """Test metrics on Fashion-MNIST's test classes under ``smoke``, seed 0: the initial
    model, the protocol's zero-shot training, and the seen-class control."""
    if not (DEBIAN_PATH / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip("Debian package dataset-fashion-mnist is not installed")
    variants = {"initial": ["--epochs", "0"], "zero-shot": [], "control": ["--seen-class-control"]}
    workdir, found = tmp_path_factory.mktemp("fashion"), {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        for name, extra in variants.items():
            out = workdir / f"{name}.json"
            assert (
                main(
                    [
                        "run",
                        "--methods",
                        "plain",
                        "--dataset",
                        "fashion-mnist",
                        "--seeds",
                        "0",
                        "--json",
                        str(out),
                        *extra,
                    ]
                )
                == 0
            )
            found[name] = json.loads(out.read_text())[0]["metrics"]
    print(
        "Fashion-MNIST "
        + "; ".join(
            f"{k}: P@1 {v['precision_at_1']:.4f} MAP@R {v['mean_average_precision_at_r']:.4f}"
            for k, v in found.items()
        )
    )
    return found


def test_training_beats_the_initial_model_when_it_sees_the_test_classes(fashion_mnist_scores):
    """Training works on real data: on other images of the test classes it ranks them far
    better (measured, seed 0, one epoch: MAP@R 46.4 -> 82.1, P@1 88.9 -> 93.4)."""
    initial, control = fashion_mnist_scores["initial"], fashion_mnist_scores["control"]
    assert control["mean_average_precision_at_r"] - initial["mean_average_precision_at_r"] >= 0.20
    assert control["precision_at_1"] - initial["precision_at_1"] >= 0.02


@pytest.mark.xfail(
    strict=True,
    reason="trained on 3 clothing classes, the model does not beat ImageNet "
    "features on shoes, bags and shirts by 5 points (docs/performance.md: the seen-class control)",
)
def test_zero_shot_training_beats_the_initial_model_by_five_points(fashion_mnist_scores):
    initial, trained = fashion_mnist_scores["initial"], fashion_mnist_scores["zero-shot"]
    assert trained["precision_at_1"] - initial["precision_at_1"] >= 0.05
