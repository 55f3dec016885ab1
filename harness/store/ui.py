"""What the MLflow UI shows of the harness's experiments: the model-development view, the
saved view of the runs table (:mod:`harness.store.runs_view`), a run's description, and
the UI's URLs. The server itself: :mod:`harness.store.ui_server`."""

from __future__ import annotations

import mlflow

from harness.store.location import tracking_uri
from harness.store.runs_view import VIEW_KEY, VIEW_NAME, outdated, view_tag

__all__ = [
    "RUN_NOTE_TAG",
    "EXPERIMENT_KIND_TAG",
    "ML_VIEW_QUERY",
    "RUNS_VIEW",
    "ui_url",
    "prepare_for_ui",
]

# MLflow is imported inside the functions that use it: importing it takes seconds, which
# commands that never open the store (--help, schema, methods) should not pay.

#: The tag whose Markdown the MLflow UI shows as a run's description.
RUN_NOTE_TAG = "mlflow.note.content"
#: MLflow's experiment-kind tag, and the kind of every experiment the harness makes: model
#: development, not a generative-AI application. The UI of MLflow 3.17 picks its view from
#: the URL and the browser instead (:mod:`harness.store.ui_server`); other readers of the
#: tag remain.
EXPERIMENT_KIND_TAG = ("mlflow.experimentKind", "custom_model_development")
#: The query parameter that opens the MLflow UI's model-training view (runs table, metric
#: charts); without it, MLflow 3 opens the generative-AI view (traces) or the browser's last.
ML_VIEW_QUERY = "workflowType=machine_learning"
#: The saved view of the runs table that every experiment carries (the UI's Views menu;
#: ``viewStateShareKey`` in a URL opens it; ``harness ui`` makes it the runs page's state in
#: a browser that holds none; :mod:`harness.store.runs_view`).
RUNS_VIEW = (VIEW_KEY, VIEW_NAME)


def prepare_for_ui(experiment: str) -> None:
    """Give experiment id ``experiment`` the tags the harness's experiments carry where it
    lacks them (made before the harness set them, or by another program): the
    model-development kind, and :data:`RUNS_VIEW` (also where the harness wrote an older
    form of it; :func:`harness.store.runs_view.outdated`)."""

    client = mlflow.MlflowClient(tracking_uri())
    present = client.get_experiment(experiment).tags
    key, kind = EXPERIMENT_KIND_TAG
    if key not in present:
        client.set_experiment_tag(experiment, key, kind)
    view_key, view = view_tag()
    if outdated(present.get(view_key)):
        client.set_experiment_tag(experiment, view_key, view)


def ui_url(base: str, experiment: str | None = None, run_id: str = "") -> str:
    """The MLflow UI's page, in the model-training view, of the experiments (no
    ``experiment``), of experiment id ``experiment``'s runs, or of its run ``run_id``. The
    runs page opens in :data:`RUNS_VIEW` where the browser holds no state of its own for
    the experiment (``harness ui``'s page sets it, :mod:`harness.store.ui_app`), editable
    there as any runs page; ``viewStateShareKey`` would open the saved view read-only."""
    if experiment is None:
        return f"{base.rstrip('/')}/#/experiments?{ML_VIEW_QUERY}"
    if run_id:
        return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?{ML_VIEW_QUERY}"
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs?{ML_VIEW_QUERY}"
