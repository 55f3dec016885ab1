"""The forest plot ``harness table`` writes beside each table: the files exist and are sane,
and the numbers drawn (the CSV beside the figure) are the paired-tests table's."""

from __future__ import annotations

import struct
import uuid

import mlflow
import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from harness.base.metric_keys import metric_key
from harness.cli.main import main
from harness.components.evaluation import PER_QUERY_ARTIFACT, save_per_query


def _run(client, exp_id, *, method, dataset, seed, r1, per_query, folder):
    rid = client.create_run(exp_id).info.run_id
    client.log_param(rid, "protocol.backbone.name", "resnet50")
    for k, v in {
        "method": method,
        "loss": "margin",
        "dataset": dataset,
        "seed": seed,
        "fingerprint": f"fp-{dataset}",
        "deviations": "none",
        "test_set_selection": "False",
        "evaluation_code": "code1",
        "selection": "validation",
    }.items():
        client.set_tag(rid, k, str(v))
    client.log_metric(rid, metric_key("test", "recall_at_1"), r1)
    client.log_metric(rid, metric_key("test", "nmi"), 0.5 + r1 / 10)
    path = folder / rid / "per_query_test.npz"
    save_per_query(path, per_query)
    client.log_artifact(rid, str(path), PER_QUERY_ARTIFACT.rsplit("/", 1)[0])
    client.set_terminated(rid, status="FINISHED")
    return rid


@pytest.fixture
def store_with_three_methods(workdir, tmp_path):
    """plain, ngrouping and agrouping on CUB and Cars, three seeds, per-query results stored."""
    from harness.store.location import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    name = f"figures-{uuid.uuid4().hex[:8]}"
    exp_id = client.create_experiment(name)
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(30), 4)
    r1 = {}
    for dataset in ("cub200", "cars196"):
        for method, shift in (("plain", 0), ("ngrouping", 1), ("agrouping", 2)):
            for seed in (0, 1, 2):
                ranks = np.maximum(rng.integers(-1, 4, size=len(labels)) - shift, 0)
                arrays = {
                    "query_index": np.arange(len(labels)),
                    "label": labels,
                    "num_relevant": np.full(len(labels), 3),
                    "first_hit_rank": ranks,
                }
                r1[(dataset, method, seed)] = float((ranks == 0).mean())
                _run(
                    client,
                    exp_id,
                    method=method,
                    dataset=dataset,
                    seed=seed,
                    r1=r1[(dataset, method, seed)],
                    per_query=arrays,
                    folder=tmp_path / "arrays",
                )
    return name, r1


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_the_forest_plot_draws_the_paired_tests_numbers(store_with_three_methods, workdir):
    name, r1 = store_with_three_methods
    out = workdir / "tables" / "three.md"
    assert (
        main(
            [
                "table",
                "--experiment",
                name,
                "--format",
                "markdown",
                "--metrics",
                "recall_at_1,nmi",
                "--baseline",
                "plain",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    pdf, png, csv = (out.with_name(f"three.forest.{ext}") for ext in ("pdf", "png", "csv"))
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5_000
    width, height = _png_size(png.read_bytes())
    assert 600 <= width <= 4000 and 300 <= height <= 4000

    drawn = pd.read_csv(csv)
    assert set(drawn["metric"]) == {"recall_at_1"}  # the table's lead metric
    assert list(drawn["dataset"]) == ["cub200", "cub200", "cars196", "cars196"]  # the table's order
    text = out.read_text()
    paired = {
        tuple(cells[1:4]): cells
        for cells in (line.strip("| ").split(" | ") for line in text.splitlines())
        if len(cells) == 9 and " vs " in cells[3]
    }
    names = {"cub200": "CUB-200-2011", "cars196": "Cars196"}
    for row in drawn.itertuples(index=False):
        cells = paired[(names[row.dataset], "R@1", row.comparison)]
        assert cells[5] == f"{row.difference:+.2f} [{row.low:+.2f}, {row.high:+.2f}]"
        assert cells[7].startswith(
            f"{row.boot_difference:+.2f} [{row.boot_low:+.2f}, {row.boot_high:+.2f}]"
        )
    # the interval drawn is the 95% Student t-interval of the per-seed differences
    a = drawn[
        (drawn["dataset"] == "cars196") & drawn["comparison"].str.startswith("A-grouping")
    ].iloc[0]
    differences = [
        100 * (r1[("cars196", "agrouping", s)] - r1[("cars196", "plain", s)]) for s in (0, 1, 2)
    ]
    low, high = scipy_stats.t.interval(
        0.95, 2, loc=np.mean(differences), scale=scipy_stats.sem(differences)
    )
    assert (a["low"], a["high"]) == (pytest.approx(low, abs=1e-5), pytest.approx(high, abs=1e-5))


def test_no_baseline_rows_no_figure(store_with_three_methods, workdir):
    name, _ = store_with_three_methods
    out = workdir / "tables" / "none.md"
    assert (
        main(
            [
                "table",
                "--experiment",
                name,
                "--format",
                "markdown",
                "--metrics",
                "recall_at_1",
                "--baseline",
                "sam",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.is_file() and not list(out.parent.glob("none.forest.*"))


def test_a_table_that_cannot_write_its_last_file_leaves_the_previous_table_and_figures(
    store_with_three_methods, workdir, capsys
):
    """The table and its forest plot are one set: the last of them refused (a folder
    stands where it goes) leaves every other previous file byte for byte, and no
    temporary file."""
    name, _ = store_with_three_methods
    out = workdir / "tables" / "set.md"
    argv = ["table", "--experiment", name, "--format", "markdown", "--out", str(out)]
    assert main([*argv, "--caption", "first"]) == 0
    files = [out, *(out.with_name(f"set.forest.{ext}") for ext in ("pdf", "png"))]
    before = {path: path.read_bytes() for path in files}
    last = out.with_name("set.forest.csv")
    last.unlink()
    last.mkdir()
    capsys.readouterr()
    assert main([*argv, "--caption", "second"]) == 2
    assert str(last) in capsys.readouterr().err  # one line naming the refused file
    assert {path: path.read_bytes() for path in files} == before
    assert b"first" in before[out]
    assert not list(out.parent.glob(".*.tmp"))
