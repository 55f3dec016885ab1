"""Every question the rest of the harness asks the tracking store, by name.

Only :mod:`harness.store` imports MLflow (pyproject.toml's import-linter contract checks
it): the engine, the reports and the command line ask these functions, and read the run
objects they return (``run.info.run_id``, ``run.data.tags``, ``run.data.metrics``)
without importing MLflow. Each function points MLflow at the project's store
(:func:`harness.store.location.tracking_uri`) first.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import mlflow
from mlflow.entities import Metric, Param, RunTag

from harness.base.errors import HarnessError
from harness.store.artifacts import PROXIED_SCHEME, proxied_local_path, resolve_proxied_locally
from harness.store.location import artifact_root, tracking_uri
from harness.store.tracking import (
    _existing_run_experiment,
    _search_runs,
    experiment_id,
    training_runs_only,
)

__all__ = [
    "client",
    "search_runs",
    "all_runs",
    "find_run",
    "set_run_tags",
    "terminate_run",
    "metric_history",
    "experiment_exists",
    "experiments_by_activity",
    "finished_runs_frame",
    "newest_finished_runs",
    "read_artifact",
    "missing_artifact",
    "run_artifact_dir",
    "log_to_run",
    "record_derived_run",
]

T = TypeVar("T")


def client():
    """An ``MlflowClient`` on the project's tracking store, whose proxied artifact URIs
    this process resolves (:func:`harness.store.artifacts.resolve_proxied_locally`)."""

    mlflow.set_tracking_uri(tracking_uri())
    resolve_proxied_locally()
    return mlflow.MlflowClient()


def search_runs(experiment: str, filter_string: str, **kwargs) -> list:
    """Runs of ``experiment`` matching ``filter_string`` (none when it does not exist);
    ``kwargs`` go to MLflow's ``search_runs`` (``order_by``, ``max_results``)."""
    return _search_runs(experiment, filter_string, **kwargs)


def all_runs(experiment: str, filter_string: str) -> list:
    """Every run of ``experiment`` matching ``filter_string``, page after page (MLflow
    returns at most 1,000 per call)."""
    out, token = [], None
    while True:
        page = _search_runs(experiment, filter_string, max_results=1000, page_token=token)
        out += list(page)
        token = getattr(page, "token", None)  # a plain list when the experiment does not exist
        if not token:
            return out


def find_run(run_id: str):
    """Run ``run_id``, or None when the store has no such run (any other failure of the
    store is one :class:`HarnessError` line)."""
    c = client()
    if _existing_run_experiment(c, run_id) is None:
        return None
    return c.get_run(run_id)


def set_run_tags(run_id: str, tags: dict[str, Any]) -> None:
    """Set each of ``tags`` (as a string) on run ``run_id``."""
    c = client()
    for key, value in tags.items():
        c.set_tag(run_id, key, str(value))


def terminate_run(run_id: str, status: str) -> None:
    """End run ``run_id`` with ``status`` (``KILLED``, ``FAILED``, ``FINISHED``)."""
    client().set_terminated(run_id, status=status)


def metric_history(run_id: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every logged value of metric ``key`` of run ``run_id``, by step."""
    return sorted((m.step, m.value) for m in client().get_metric_history(run_id, key))


def experiment_exists(name: str) -> bool:

    mlflow.set_tracking_uri(tracking_uri())
    return mlflow.get_experiment_by_name(name) is not None


def experiments_by_activity() -> list[tuple[str, str]]:
    """``(id, name)`` of the store's experiments that hold runs, the most recently
    updated first."""
    experiments = client().search_experiments(order_by=["last_update_time DESC"])
    return [
        (e.experiment_id, e.name)
        for e in experiments
        if client().search_runs([e.experiment_id], max_results=1)
    ]


def finished_runs_frame(experiments: Sequence[str]):
    """``(frame, {experiment id: name})``: one row per FINISHED run of ``experiments``
    (MLflow's ``search_runs`` pandas frame: ``run_id``, ``experiment_id``, ``start_time``,
    ``tags.*``, ``params.*``, ``metrics.*``). An experiment the store does not have is
    one error line that lists those it has."""

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    ids = {}
    for name in experiments:
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            known = sorted(e.name for e in mlflow.search_experiments())
            raise HarnessError(
                f"no MLflow experiment '{name}' in {uri}; experiments there: "
                f"{', '.join(known) or 'none'}"
            )
        ids[exp.experiment_id] = name
    frame = mlflow.search_runs(
        experiment_ids=list(ids),
        filter_string=training_runs_only("attributes.status = 'FINISHED'"),
        output_format="pandas",
    )
    return frame, ids


def newest_finished_runs(experiments: Sequence[str]) -> list:
    """The FINISHED runs of ``experiments``, newest first; an experiment the store does
    not have is one error line."""

    mlflow.set_tracking_uri(tracking_uri())
    missing = sorted(e for e in set(experiments) if mlflow.get_experiment_by_name(e) is None)
    if missing:
        raise HarnessError(
            f"no experiment {', '.join(map(repr, missing))} in the tracking store {tracking_uri()}"
        )
    return mlflow.search_runs(
        experiment_names=list(experiments),
        filter_string=training_runs_only("attributes.status = 'FINISHED'"),
        output_format="list",
        order_by=["attributes.start_time DESC"],
    )


def _recorded_artifact_dir(run) -> Path | None:
    """The local folder MLflow recorded for the run's artifacts (``file:`` URI or plain
    path, or a proxied URI of a SQLite store: :func:`harness.store.artifacts.proxied_local_path`);
    None for a remote artifact store."""

    uri = run.info.artifact_uri or ""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == PROXIED_SCHEME:
        return proxied_local_path(uri, tracking_uri())
    return Path(uri) if parsed.scheme == "" and uri else None


def run_artifact_dir(run) -> Path | None:
    """Where the artifacts of ``run`` (a run object) are now, on this machine.

    MLflow records an absolute location per run (``<experiment's root>/<run id>/artifacts``),
    which a copied or moved store no longer matches. The store's own artifact folder
    (:func:`harness.store.location.artifact_root`, beside the database file) comes first, so a
    copy reads its own artifacts; the recorded location serves runs of experiments created
    elsewhere. None for a remote artifact store (MLflow downloads from there). The returned
    folder may not exist: :func:`missing_artifact` says so."""
    recorded = _recorded_artifact_dir(run)
    if recorded is None:
        return None
    beside_store = artifact_root() / run.info.run_id / "artifacts"
    for folder in (beside_store, recorded):
        if folder.is_dir():
            return folder
    # Neither exists: name the folder this store's layout expects when the run was
    # recorded in that layout (an ``mlartifacts`` root), else the recorded one.
    return beside_store if recorded.parent.parent.name == artifact_root().name else recorded


def read_artifact(run_id: str, path: str, reader: Callable[[Path], T]) -> T | None:
    """``reader`` applied to artifact ``path`` of run ``run_id`` (read in place from a local
    store, found by :func:`run_artifact_dir`; downloaded to a temporary folder from a remote
    one); None when the run has no such artifact (:func:`missing_artifact` says why)."""
    os.environ.setdefault(
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false"
    )  # one bar per run otherwise
    c = client()
    local = run_artifact_dir(c.get_run(run_id))
    if local is not None:
        file = local / path
        return reader(file) if file.is_file() else None
    folder = path.rsplit("/", 1)[0] if "/" in path else ""
    if not any(a.path == path for a in c.list_artifacts(run_id, folder or None)):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return reader(Path(c.download_artifacts(run_id, path, tmp)))


def missing_artifact(run_id: str, path: str) -> str:
    """Why run ``run_id`` has no artifact ``path``, in a few words naming where it was
    looked for; empty when the artifact is there."""
    c = client()
    local = run_artifact_dir(c.get_run(run_id))
    if local is None:
        folder = path.rsplit("/", 1)[0] if "/" in path else ""
        found = any(a.path == path for a in c.list_artifacts(run_id, folder or None))
        return "" if found else f"no artifact {path} in the run's artifact store"
    if (local / path).is_file():
        return ""
    if not local.is_dir():
        return (
            f"artifact {path} missing: the run's artifact folder {local} does not exist (was the store's "
            f"{artifact_root().name} folder left behind when it was copied?)"
        )
    return f"artifact {path} missing from {local}"


def log_to_run(
    run_id: str,
    *,
    metrics: dict[str, float],
    tags: dict[str, str],
    texts: dict[str, str],
    artifacts: Sequence[tuple[Path, str]],
) -> None:
    """Add to a run, finished or not: ``metrics`` (step 0), ``tags``, ``texts``
    (``{artifact path: text}``) and files (``(path, artifact folder)``)."""

    c = client()
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
    for i in range(0, len(items), 500):
        c.log_batch(run_id, metrics=items[i : i + 500])
    if tags:
        c.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
    for name, text in texts.items():
        c.log_text(run_id, text, name)
    for path, folder in artifacts:
        c.log_artifact(run_id, str(path), folder)


def record_derived_run(
    experiment: str,
    source_run_id: str,
    *,
    run_name: str,
    tags: dict[str, Any],
    metrics: dict[str, float],
    artifacts: Sequence[tuple[Path, str]] = (),
    drop: Sequence[str] = (),
) -> str:
    """A FINISHED run of ``experiment`` that trains nothing and reports ``metrics``: a
    result derived from other runs (a tuned grid's "separated" mean over fold models, or
    their "concatenated" embeddings). It carries the params and tags of ``source_run_id``
    (what was trained, under which protocol) less the tags in ``drop`` (what describes
    the source run alone), then ``tags`` on top, and ``artifacts`` (``(file, artifact
    folder)``). Returns its run id."""

    c = client()
    source = c.get_run(source_run_id)
    run = c.create_run(experiment_id(experiment), run_name=run_name)
    run_id = run.info.run_id
    params = [Param(k, v) for k, v in source.data.params.items()]
    for i in range(0, len(params), 100):
        c.log_batch(run_id, params=params[i : i + 100])
    inherited = {
        k: v
        for k, v in source.data.tags.items()
        if not k.startswith(("mlflow.", "model_")) and k not in drop
    }
    items = [RunTag(k, str(v)[:5000]) for k, v in {**inherited, **tags}.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, tags=items[i : i + 100])
    now = int(time.time() * 1000)
    values = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
    for i in range(0, len(values), 500):
        c.log_batch(run_id, metrics=values[i : i + 500])
    for path, folder in artifacts:
        c.log_artifact(run_id, str(path), folder)
    c.set_terminated(run_id, "FINISHED")
    return run_id
