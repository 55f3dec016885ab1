"""What the MLflow UI shows of the harness's experiments: the model-development view, the
saved view of the runs table, a run's description, and the UI's server command and URLs."""

from __future__ import annotations

import json
import sys
import time

from harness.base.metric_keys import HEADLINE, metric_key
from harness.store.location import artifact_root, tracking_uri

__all__ = [
    "RUN_NOTE_TAG",
    "EXPERIMENT_KIND_TAG",
    "ML_VIEW_QUERY",
    "RUNS_VIEW",
    "ui_server_command",
    "ui_url",
    "prepare_for_ui",
    "runs_view_tag",
]

# MLflow is imported inside the functions that use it: importing it takes seconds, which
# commands that never open the store (--help, schema, methods) should not pay.

#: The tag whose Markdown the MLflow UI shows as a run's description.
RUN_NOTE_TAG = "mlflow.note.content"
#: MLflow's experiment-kind tag, and the kind of every experiment the harness makes: the
#: UI then treats it as model development, not as a generative-AI application.
EXPERIMENT_KIND_TAG = ("mlflow.experimentKind", "custom_model_development")
#: The query parameter that opens the MLflow UI's model-training view (runs table, metric
#: charts); without it, MLflow 3 opens the generative-AI view (traces) or the browser's last.
ML_VIEW_QUERY = "workflowType=machine_learning"
#: The saved view of the runs table that every experiment carries (the UI's Views menu;
#: ``viewStateShareKey`` in a URL opens it): the headline test metrics as columns, best
#: P@1 first. MLflow keeps column choices in the browser otherwise, so a new user would
#: see no metric column at all.
RUNS_VIEW = ("metric-learning", "Metric learning")


def ui_server_command(host: str, port: int) -> list[str]:
    """The ``mlflow server`` command line of the MLflow UI over the tracking store, its
    artifacts in :func:`~harness.store.location.artifact_root` (where
    :func:`harness.store.tracking.experiment_id` puts them)."""
    artifacts = artifact_root()
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        tracking_uri(),
        "--default-artifact-root",
        artifacts.as_uri(),
        "--host",
        host,
        "--port",
        str(port),
    ]


def prepare_for_ui(experiment: str) -> None:
    """Give experiment id ``experiment`` the tags the harness's experiments carry (the
    model-development kind, :data:`RUNS_VIEW`) where it lacks them (made before the
    harness set them, or by another program)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri())
    present = client.get_experiment(experiment).tags
    for key, value in (EXPERIMENT_KIND_TAG, runs_view_tag()):
        if key not in present:
            client.set_experiment_tag(experiment, key, value)


def runs_view_tag() -> tuple[str, str]:
    """The experiment tag of :data:`RUNS_VIEW`, in the envelope MLflow's UI saves views in
    (``mlflow.sharedViewState.<key>``: name, times, and the table's state as JSON)."""
    columns = [f"attributes.`{name}`" for name in ("Source", "Models", "Dataset")]
    columns += [f"metrics.`{metric_key('test', name)}`" for name in HEADLINE]
    columns += ["params.`seed`", "tags.`selected_epoch`"]
    state = {
        "selectedColumns": columns,
        "orderByKey": f"metrics.`{metric_key('test', HEADLINE[0])}`",
        "orderByAsc": False,
    }
    now = int(time.time() * 1000)
    key, name = RUNS_VIEW
    return (
        f"mlflow.sharedViewState.{key}",
        json.dumps({"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)}),
    )


def ui_url(base: str, experiment: str | None = None, run_id: str = "") -> str:
    """The MLflow UI's page, in the model-training view, of the experiments (no
    ``experiment``), of experiment id ``experiment``'s runs (in :data:`RUNS_VIEW`), or of
    its run ``run_id``."""
    if experiment is None:
        return f"{base.rstrip('/')}/#/experiments?{ML_VIEW_QUERY}"
    if run_id:
        return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?{ML_VIEW_QUERY}"
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs?{ML_VIEW_QUERY}&viewStateShareKey={RUNS_VIEW[0]}"
