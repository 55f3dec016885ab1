"""Tracking-store faults: only "no such run" starts a new run when one is reopened; search
values with quotes are written so that MLflow's filter syntax matches them."""

from __future__ import annotations

import os
import types

import mlflow
import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, RESOURCE_DOES_NOT_EXIST

from harness.base.errors import HarnessError

# ------------------------------------------------------------------- tracking errors


def test_only_a_missing_run_starts_a_new_one(workdir, monkeypatch):
    from harness.store.tracking import Tracker

    first = Tracker("reopen", "r")
    first.finish("KILLED")
    assert Tracker("reopen", "r", run_id="0" * 32).resumed is False  # the store: no such run

    def locked(self, run_id):
        raise MlflowException(
            "(sqlite3.OperationalError) database is locked", error_code=INTERNAL_ERROR
        )

    monkeypatch.setattr(mlflow.MlflowClient, "get_run", locked)
    before = len(mlflow.search_runs(experiment_names=["reopen"], output_format="list"))
    with pytest.raises(
        HarnessError, match=f"cannot look up run '{first.run_id}'.*database is locked"
    ):
        Tracker("reopen", "r", run_id=first.run_id)
    monkeypatch.undo()
    assert len(mlflow.search_runs(experiment_names=["reopen"], output_format="list")) == before

    def missing(self, run_id):
        raise MlflowException(f"Run '{run_id}' not found", error_code=RESOURCE_DOES_NOT_EXIST)

    monkeypatch.setattr(mlflow.MlflowClient, "get_run", missing)
    monkeypatch.setattr(
        mlflow.MlflowClient,
        "create_run",
        lambda self, exp, run_name=None: types.SimpleNamespace(
            info=types.SimpleNamespace(run_id="new")
        ),
    )
    assert Tracker("reopen", "r", run_id=first.run_id).run_id == "new"


# ------------------------------------------------------------------- search filters


def test_search_values_with_quotes_are_quoted_for_mlflow(workdir):
    from harness.engine.grid.sweep import runs_of_cell
    from harness.store.tracking import filter_value

    client = mlflow.MlflowClient()
    experiment = client.create_experiment(f"quotes-{os.getpid()}-{id(client)}")
    values = {"fingerprint": "fp'1", "method": 'plain "v2"', "seed": "0", "dataset": "o'brien"}
    run = client.create_run(experiment, tags=values)
    client.set_terminated(run.info.run_id)
    client.create_run(experiment, tags={**values, "dataset": "other"})
    for key, value in values.items():
        found = client.search_runs(
            [experiment], filter_string=f"tags.{key} = {filter_value(value)}"
        )
        assert run.info.run_id in {r.info.run_id for r in found}
    grid = types.SimpleNamespace(experiment=client.get_experiment(experiment).name)
    cell = types.SimpleNamespace(method=values["method"], seed=0, dataset=values["dataset"])
    (found,) = runs_of_cell(grid, cell, values["fingerprint"], "FINISHED")
    assert found.info.run_id == run.info.run_id
    with pytest.raises(HarnessError, match="both ' and \""):
        filter_value("""it's "both" """)
