"""A run's record, as ``rerun`` reads it back: its status, params, tags, final metric
values and the artifacts that hold what made it (the resolved protocol, the deviations);
the runs of an experiment a filter selects; and the verdicts of its reruns, kept as a tag
on the run they re-ran."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError
from harness.store.location import tracking_uri
from harness.store.queries import client, find_run, read_artifact, set_run_tags
from harness.store.tracking import training_runs_only

__all__ = [
    "RunRecord",
    "RERUN_OF_TAG",
    "RERUNS_TAG",
    "LAST_RERUN_TAG",
    "read_record",
    "read_json_artifact",
    "read_text_artifact",
    "experiment_runs",
    "add_rerun_verdict",
    "rerun_counts",
]

#: The tag of a rerun naming the run it re-ran.
RERUN_OF_TAG = "rerun_of"
#: The tag of a re-run run counting its reruns' verdicts (JSON: ``{"IDENTICAL": 2}``).
RERUNS_TAG = "reruns"
#: The tag of a re-run run holding its latest rerun's verdict (what tables mark).
LAST_RERUN_TAG = "rerun.last"


@dataclass(frozen=True)
class RunRecord:
    """One tracked run as it was recorded: ids, status, params and tags (strings, as MLflow
    keeps them) and the last logged value of each metric."""

    run_id: str
    experiment: str
    status: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float]

    def tag(self, key: str, default: str = "") -> str:
        return self.tags.get(key, default)


def read_record(run_id: str) -> RunRecord:
    """The record of run ``run_id``; one line when the store holds no such run."""
    run = find_run(run_id)
    if run is None:
        raise HarnessError(
            f"no run '{run_id}' in the tracking store at {tracking_uri()} (a run of another "
            f"store is read with MLFLOW_TRACKING_URI set to that store)"
        )
    experiment = client().get_experiment(run.info.experiment_id).name
    return RunRecord(
        run_id=run.info.run_id,
        experiment=experiment,
        status=run.info.status,
        params=dict(run.data.params),
        tags=dict(run.data.tags),
        metrics=dict(run.data.metrics),
    )


def read_json_artifact(run_id: str, path: str) -> Any:
    """The JSON artifact ``path`` of run ``run_id`` (found where a moved store keeps it),
    or None when the run has none."""
    return read_artifact(run_id, path, lambda file: json.loads(Path(file).read_text()))


def read_text_artifact(run_id: str, path: str) -> str | None:
    """The text artifact ``path`` of run ``run_id``, or None when the run has none."""
    return read_artifact(run_id, path, lambda file: Path(file).read_text())


def experiment_runs(experiment: str, filter_string: str = "") -> list[str]:
    """The ids of the runs of ``experiment`` that ``filter_string`` selects (MLflow's search
    syntax), oldest first; one line when the experiment does not exist or MLflow rejects
    the filter (its own message quoted)."""
    c = client()
    found = c.get_experiment_by_name(experiment)
    if found is None:
        raise HarnessError(
            f"no experiment '{experiment}' in the tracking store at {tracking_uri()}"
        )
    runs, token = [], None
    while True:
        try:
            page = c.search_runs(
                [found.experiment_id],
                filter_string=training_runs_only(filter_string),
                order_by=["attributes.start_time ASC"],
                max_results=1000,
                page_token=token,
            )
        except Exception as err:  # MLflow raises its own exception for a malformed filter
            if type(err).__name__ != "MlflowException":
                raise
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise HarnessError(
                f"--filter {filter_string!r}: MLflow rejects it: {message}"
            ) from None
        runs += [r.info.run_id for r in page]
        token = page.token
        if not token:
            return runs


def rerun_counts(record: RunRecord) -> Counter[str]:
    """How many reruns of ``record`` gave each verdict."""
    text = record.tag(RERUNS_TAG)
    return Counter(json.loads(text)) if text else Counter()


def add_rerun_verdict(record: RunRecord, verdict: str) -> None:
    """Count one more rerun of ``record`` with ``verdict`` in its tags, and keep it as the
    latest."""
    counts = rerun_counts(record)
    counts[verdict] += 1
    set_run_tags(
        record.run_id,
        {RERUNS_TAG: json.dumps(dict(sorted(counts.items()))), LAST_RERUN_TAG: verdict},
    )
