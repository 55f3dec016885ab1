"""The table set inside the tracking store: ``harness table`` logs its files to a run
named after the table, the experiment's description links it, each run gets its distance
to the published value (``delta/*``), and the table run never counts as a result."""

from __future__ import annotations

import math

import mlflow
import pandas as pd
import pytest

from harness.reports.tables import published_deltas
from harness.store.queries import finished_runs_frame
from harness.store.records import experiment_runs
from harness.store.tables import TABLES_FOLDER, linked_description, table_run
from harness.store.tracking import TABLE_SET_TAG
from tests.table_runs import PUBLISHED, fake_run, runs_frame, table_parser

NOTE = "mlflow.note.content"


def _table(experiment: str, fmt: str) -> int:
    args = table_parser().parse_args(
        ["table", "--experiment", experiment, "--format", fmt]
        + ["--published", str(PUBLISHED), "--table", "3"]
    )
    return args.func(args)


def test_the_table_set_is_logged_to_a_run_named_after_the_table(experiment, workdir, capsys):
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment(experiment)
    client.set_experiment_tag(exp_id, NOTE, "Our CUB runs.")
    best = fake_run(client, exp_id, method="agrouping", seed=0, r1=0.70)
    fake_run(client, exp_id, method="agrouping", seed=1, r1=0.72)
    failed = fake_run(client, exp_id, method="ngrouping", seed=1, r1=0.1, status="FAILED")
    assert _table(experiment, "markdown") == 0
    first = capsys.readouterr().out
    assert _table(experiment, "latex") == 0  # the same run gets the LaTeX table too
    capsys.readouterr()
    assert _table(experiment, "markdown") == 0  # the table run is no result of the experiment
    assert capsys.readouterr().out == first

    runs = client.search_runs([exp_id], filter_string=f"tags.{TABLE_SET_TAG} = '{experiment}'")
    assert len(runs) == 1 and runs[0].info.run_name == experiment
    assert runs[0].info.status == "FINISHED"
    logged = {f.path for f in client.list_artifacts(runs[0].info.run_id, TABLES_FOLDER)}
    assert {f"{TABLES_FOLDER}/{experiment}.md", f"{TABLES_FOLDER}/{experiment}.tex"} <= logged

    description = client.get_experiment(exp_id).tags[NOTE]
    assert description.endswith("\n\nOur CUB runs.")  # the user's words are kept
    link = f"#/experiments/{exp_id}/runs/{runs[0].info.run_id}/artifacts/{TABLES_FOLDER}"
    assert description.count(link) == 1

    # Table 3, ResNet-50 + margin, A-grouping on CUB: R@1 68.62 published.
    delta = client.get_run(best).data.metrics["delta/recall_at_1"]
    assert math.isclose(delta, 70.0 - 68.62, abs_tol=1e-9)
    assert not any(k.startswith("delta/") for k in client.get_run(failed).data.metrics)

    frame, _ = finished_runs_frame([experiment])
    assert runs[0].info.run_id not in set(frame["run_id"])
    assert runs[0].info.run_id not in experiment_runs(experiment)
    assert table_run(experiment, experiment) == runs[0].info.run_id


def test_the_description_keeps_its_text_and_every_table_link():
    first = linked_description("Runs of the grid.", "7", {"grid-a": "abc"})
    second = linked_description(first, "7", {"grid-b": "def"})
    again = linked_description(second, "7", {"grid-a": "123"})
    assert again.endswith("\n\nRuns of the grid.")
    assert again.count("Runs of the grid.") == 1
    assert "(#/experiments/7/runs/123/artifacts/tables)" in again
    assert "/runs/abc/" not in again and "(#/experiments/7/runs/def/" in again
    assert linked_description("", "7", {"g": "r1"}).count("[g](") == 1


@pytest.mark.parametrize("published_loss", ["margin", "contrastive"])
def test_a_delta_is_the_run_minus_its_cells_published_value(published_loss):
    runs = runs_frame(
        [
            {"run_id": "a", "method": "agrouping", "test_recall_at_1": 0.65, "test_nmi": 0.5},
            {"run_id": "b", "method": "ngrouping", "test_recall_at_1": 0.60},
        ]
    )
    published = pd.DataFrame(
        [
            {"backbone": "resnet50", "loss": published_loss, "method": "agrouping"}
            | {"dataset": "cub200", "metric": "recall_at_1", "value": 63.5},
        ]
    )
    deltas = published_deltas(runs, published, ["recall_at_1", "nmi"])
    if published_loss == "margin":
        assert deltas.keys() == {"a"} and math.isclose(deltas["a"]["recall_at_1"], 1.5)
        assert "nmi" not in deltas["a"]  # no published NMI: no delta
    else:
        assert deltas == {}  # another loss's value is another cell's
