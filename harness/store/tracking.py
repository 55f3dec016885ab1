"""MLflow tracking: the store every number is reproduced from.

One MLflow run per harness run (:class:`Tracker`), in an experiment made for the model
development view of the UI (:func:`experiment_id`). Each run records the full protocol,
fingerprint, deviations, method options, seed, git commit and package versions
(:mod:`harness.store.provenance`). Where the store is: :mod:`harness.store.location`.
The experiments the harness makes in a SQLite store record their artifacts under MLflow's
proxied scheme, relative to the folder beside the database (:mod:`harness.store.artifacts`),
so the MLflow UI and ``mlflow.pytorch.load_model`` follow a moved store too.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pytorch
from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.utils.mlflow_tags import (
    MLFLOW_DATASET_CONTEXT,
    MLFLOW_GIT_COMMIT,
    MLFLOW_SOURCE_NAME,
    MLFLOW_SOURCE_TYPE,
)

from harness.base.errors import HarnessError
from harness.base.metric_keys import LOSS_KEY, READABLE, RELATIVE_LOSS_KEY, display_copies
from harness.config.overrides import flatten_keys
from harness.store.artifacts import PROXIED_ROOT, resolve_proxied_locally, sqlite_artifact_folder
from harness.store.location import artifact_root, tracking_uri
from harness.store.model_folder import embedder_signature, free_sizes, model_requirements
from harness.store.provenance import harness_version
from harness.store.runs_view import view_tag
from harness.store.ui import EXPERIMENT_KIND_TAG, RUN_NOTE_TAG, prepare_for_ui

__all__ = [
    "flatten",
    "experiment_id",
    "Tracker",
    "filter_value",
    "newest_run",
    "MODEL_NAME",
    "TABLE_SET_TAG",
    "training_runs_only",
]

# MLflow and torch are imported inside the functions that use them: importing them takes
# seconds, which commands that never open the store (--help, schema, methods) should not pay.

#: The name of a logged MLflow model when its caller gives none (the runs of the harness
#: name theirs after the run: method, dataset, loss and seed).
MODEL_NAME = "embedder"


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}`` (lists as JSON) for MLflow params."""
    return {
        f"{prefix}{key}": json.dumps(value)
        if isinstance(value, list | tuple | dict)
        else str(value)
        for key, value in flatten_keys(data).items()
    }


def filter_value(value: Any) -> str:
    """``value`` as a string literal of MLflow's search syntax (``filter_string``).

    MLflow takes a string between single or double quotes and strips them without
    unescaping anything: neither a doubled quote nor a backslash escapes one (checked on
    MLflow 3.17: ``'it''s'`` and ``'it\\'s'`` match nothing). So a value is quoted with
    the quote it does not contain; one holding both kinds cannot be written at all, and
    is one clear error instead of a filter that silently matches nothing or breaks."""
    text = str(value)
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text:
        return f'"{text}"'
    raise HarnessError(
        f"cannot search the tracking store for {text!r}: MLflow's filter syntax has no "
        f"way to write a value holding both ' and \"; rename it"
    )


#: The tag of the run that holds a table set (:mod:`harness.store.tables`): the table's name.
TABLE_SET_TAG = "table_set"


def training_runs_only(filter_string: str = "") -> str:
    """``filter_string`` (MLflow's search syntax) narrowed to the runs that trained or
    evaluated a model: a table set's run is no result of its experiment, so tables,
    reruns, grids and studies never count it."""
    only = f"tags.{TABLE_SET_TAG} IS NULL"
    return f"{filter_string} and {only}" if filter_string.strip() else only


def _search_runs(experiment: str, filter_string: str, **kwargs) -> list:
    """The training runs of ``experiment`` matching ``filter_string`` (none when it does
    not exist; :func:`training_runs_only`)."""

    mlflow.set_tracking_uri(tracking_uri())
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return mlflow.MlflowClient().search_runs(
        [exp.experiment_id], filter_string=training_runs_only(filter_string), **kwargs
    )


def newest_run(experiment: str, filter_string: str) -> str | None:
    """The id of the newest run of ``experiment`` matching ``filter_string``, or None."""
    runs = _search_runs(
        experiment, filter_string, order_by=["attributes.start_time DESC"], max_results=1
    )
    return runs[0].info.run_id if runs else None


def experiment_id(name: str) -> str:
    """The id of MLflow experiment ``name``, created on first use, of the model-development
    kind (:data:`EXPERIMENT_KIND_TAG`); in a SQLite store its artifacts are recorded as
    proxied URIs relative to :func:`~harness.store.location.artifact_root`
    (:mod:`harness.store.artifacts`), which this process then resolves there. Sweep workers
    start together: when another process creates it between our look-up and our create,
    the store's unique-name constraint fails ours, and we take theirs."""

    resolve_proxied_locally()
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        prepare_for_ui(exp.experiment_id)
        return exp.experiment_id
    artifacts = artifact_root()
    artifacts.mkdir(parents=True, exist_ok=True)
    proxied = sqlite_artifact_folder(tracking_uri()) is not None
    try:
        return mlflow.create_experiment(
            name,
            artifact_location=PROXIED_ROOT if proxied else artifacts.as_uri(),
            tags=dict([EXPERIMENT_KIND_TAG, view_tag()]),
        )
    except mlflow.exceptions.MlflowException:
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


class Tracker:
    """A thin wrapper over one MLflow run (start or resume, log, finish or fail)."""

    def __init__(self, experiment: str, run_name: str, run_id: str | None = None):

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri())
        exp_id = experiment_id(experiment)
        self.experiment_id = exp_id
        self.client = mlflow.MlflowClient()
        #: The logged models of this run logged here (their ids), which take its description.
        self.model_ids: list[str] = []
        #: The artifact paths of the files logged here (``views/embedding_map.png``).
        self.logged: list[str] = []
        #: Whether ``run_id`` was found and continues; False when a new run was created
        #: (also when a checkpoint names a run that is not in this store and experiment:
        #: resuming another experiment's run would leave this experiment without it).
        self.resumed = False
        if run_id is not None:
            # Only "no such run" may start a new run: any other failure (a locked or
            # unreachable database) would otherwise silently split one run into two.
            self.resumed = _existing_run_experiment(self.client, run_id) == exp_id
            if not self.resumed:
                run_id = None
        if run_id is None:
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        #: The run's first logged training loss (the divisor of ``train/relative_loss``).
        self.first_loss: float | None = None

    def log_params(self, params: dict[str, Any]) -> None:

        existing = self.client.get_run(self.run_id).data.params
        fresh = [
            Param(k[:250], str(v)[:6000]) for k, v in params.items() if k[:250] not in existing
        ]
        for i in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Tags of the run; its description (:data:`RUN_NOTE_TAG`) is also the description of
        the models logged here, which the UI's model page shows."""

        items = [RunTag(k, str(v)[:5000]) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, tags=items[i : i + 100])
        if RUN_NOTE_TAG in tags:
            for model_id in self.model_ids:
                self.client.set_logged_model_tags(model_id, {RUN_NOTE_TAG: str(tags[RUN_NOTE_TAG])})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """``metrics`` at ``step``, and beside each headline metric of the test and validation
        splits its display copy, a percentage (:func:`~harness.base.metric_keys.display_copies`),
        at the same step."""

        now = int(time.time() * 1000)
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        numbers.update(display_copies(numbers))
        items = [Metric(k, v, now, step or 0) for k, v in numbers.items()]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def log_metric_steps(self, series: dict[str, list[tuple[int, float]]]) -> None:
        """Several values of each metric, each at its own step, in one request:
        ``{"train/loss": [(step, value), ...]}``; beside the training loss, the same curve
        divided by the run's first loss (:data:`~harness.base.metric_keys.RELATIVE_LOSS_KEY`)."""

        series = {**series, **self.relative_loss(series.get(LOSS_KEY, []))}
        now = int(time.time() * 1000)
        items = [
            Metric(name, float(value), now, step)
            for name, points in series.items()
            for step, value in points
        ]
        for start in range(0, len(items), 1000):  # MLflow takes at most 1000 metrics a request
            self.client.log_batch(self.run_id, metrics=items[start : start + 1000])

    def relative_loss(self, points: list[tuple[int, float]]) -> dict[str, list]:
        """``points`` of the training loss as ``{train/relative_loss: [(step, loss / first
        loss)]}``; the first loss is the run's first logged one (read back from the store
        when the run resumes). None where the first loss is zero or not finite."""
        if not points:
            return {}
        if self.first_loss is None:
            history = self.client.get_metric_history(self.run_id, LOSS_KEY) if self.resumed else []
            first = min(history, key=lambda m: m.step) if history else None
            self.first_loss = float(first.value if first is not None else points[0][1])
        if self.first_loss == 0 or not math.isfinite(self.first_loss):
            return {}
        return {RELATIVE_LOSS_KEY: [(step, value / self.first_loss) for step, value in points]}

    def log_dataset(
        self,
        name: str,
        digest: str,
        *,
        data_root: Path | None = None,
        sizes: dict[str, int] | None = None,
        context: str = "train/val/test",
        extra: dict[str, str] | None = None,
    ) -> None:
        """The run's dataset as an MLflow dataset input (name, split digest, image counts),
        so the UI lists it and runs on the same split share one dataset entry. Metadata
        only (``MetaDataset``): the images stay where the data root has them. ``extra``:
        more fields of its source (a dataset given by its path: the path, its fingerprint)."""

        source = CodeDatasetSource(
            {
                "loader": f"harness.components.data:{name}",
                "data_root": str(data_root or "default"),
                **{f"num_{k}_images": str(v) for k, v in (sizes or {}).items()},
                **(extra or {}),
            }
        )
        dataset = MetaDataset(source, name=name, digest=digest)  # type: ignore[abstract]  # mlflow's Dataset is no ABC; MetaDataset leaves profile abstract
        inputs = [
            DatasetInput(
                dataset._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)]
            )
        ]
        try:
            self.client.log_inputs(self.run_id, datasets=inputs)
        except self.mlflow.exceptions.MlflowException as err:
            # The store looks the dataset up, then inserts it: sweep workers starting runs on
            # one split together race there, and the loser fails the dataset's unique key
            # (seen with 3 workers on SQLite). The dataset exists now: the retry links to it.
            if "UNIQUE constraint" not in str(err) and "unique constraint" not in str(err).lower():
                raise
            self.client.log_inputs(self.run_id, datasets=inputs)

    def log_artifact(self, path: Path, folder: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), folder)
        self.logged.append(f"{folder}/{Path(path).name}" if folder else Path(path).name)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def log_pytorch_model(
        self,
        model,
        input_example,
        output_example,
        *,
        name: str = MODEL_NAME,
        registered_name: str = "",
        step: int = 0,
        tags: dict[str, str] | None = None,
    ) -> str:
        """``model`` as an MLflow model of the pytorch flavour on this run (the UI's Models
        tab; ``mlflow.pytorch.load_model(f"runs:/{run_id}/{name}")`` loads it), with the
        signature of ``input_example`` -> ``output_example`` and ``tags`` (shown in the
        Models tab); registered as ``registered_name`` when given. Returns the model's URI.
        The model's source is the run's (the harness command and its commit): MLflow would
        name the Python file that logged it, ``__main__.py`` for every harness command.

        The model carries the run's final metrics (:meth:`_link_final_metrics`); ``step``,
        the epoch its weights were selected at, is its tag ``selected_epoch``. MLflow links
        to a model the run's metrics logged at the step the model is logged at: at the
        selected epoch that would give it the per-step ``train/loss`` of that global step.
        So the model is logged after the run's last step, where no metric is.

        Kept cheap: the pip requirements are named (MLflow would otherwise load the model
        in a subprocess to infer them) and the input example is not run again through a
        serving round trip (the caller computed ``output_example`` from it)."""

        latest = self._latest_metrics()
        after = max((m.step for m in latest.values()), default=-1) + 1
        # The logged model belongs to the fluent API's active experiment, not to the run's.
        mlflow.set_experiment(experiment_id=self.experiment_id)
        # "pt2": the graph exported by torch.export, loaded without unpickling code (and
        # without this project's source); the signature leaves the batch, height and width
        # free, and a batch of two keeps the batch dimension dynamic.
        with free_sizes():
            info = mlflow.pytorch.log_model(
                model,
                name=name,
                signature=embedder_signature(input_example, output_example),
                input_example=input_example,
                pip_requirements=_model_requirements(),
                run_id=self.run_id,
                step=after,
                tags={**self._source_tags(), **(tags or {}), "selected_epoch": str(step)},
                registered_model_name=registered_name or None,
                serialization_format="pt2",
                validate_serving_input=False,
            )
        self.model_ids.append(info.model_id)
        self._link_final_metrics(info.model_id, latest)
        return info.model_uri

    def _latest_metrics(self, keys: Iterable[str] | None = None) -> dict:
        """The run's latest point of each metric (of those named ``keys``, default all;
        MLflow's latest: the highest step, then the latest time), as MLflow ``Metric``
        objects by key."""
        latest = {}
        logged = self.client.get_run(self.run_id).data.metrics
        for key in logged if keys is None else [k for k in keys if k in logged]:
            history = self.client.get_metric_history(self.run_id, key)
            if history:
                latest[key] = max(history, key=lambda m: (m.step, m.timestamp))
        return latest

    def _link_final_metrics(self, model_id: str, latest: dict) -> None:
        """Link the run's final metrics (``latest``) to logged model ``model_id``, so that
        its page shows them; the display copies of the test metrics excepted, which
        :meth:`log_model_scores` links with the dataset. The points are the run's own (same
        time and step), so the run's history gains none."""

        items = [
            Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id)
            for m in latest.values()
            if m.key not in READABLE.values()
        ]
        for start in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[start : start + 1000])

    def _source_tags(self) -> dict[str, str]:
        """The run's source tags (command, source type, commit)."""

        tags = self.client.get_run(self.run_id).data.tags
        keys = (MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE, MLFLOW_GIT_COMMIT, "command")
        return {key: tags[key] for key in keys if key in tags}

    def log_model_scores(
        self, model_uri: str, scores: dict[str, float], dataset: tuple[str, str]
    ) -> None:
        """``scores`` of the logged model ``model_uri`` (``models:/<id>``) on ``dataset``
        (name, digest of its split, as :meth:`log_dataset` logged it), as metrics of this
        run that MLflow links to the model and the dataset: the UI's Models tab lists the
        model's dataset and these scores under it. A score the run holds already (a display
        copy of a test metric) is linked as that point; one linked to the model already
        stays as it is."""

        now = int(time.time() * 1000)
        model_id = model_uri.removeprefix("models:/")
        linked = {m.key for m in self.client.get_logged_model(model_id).metrics or []}
        latest = self._latest_metrics(scores)
        name, digest = dataset
        items = []
        for key, value in scores.items():
            if key in linked:
                continue
            own = latest.get(key)
            timestamp, step = (own.timestamp, own.step) if own and own.value == value else (now, 0)
            items.append(
                Metric(
                    key,
                    float(value),
                    timestamp,
                    step,
                    model_id=model_id,
                    dataset_name=name,
                    dataset_digest=digest,
                )
            )
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def finish(self, status: str = "FINISHED") -> None:
        if status == "FINISHED" and "failure" in self.client.get_run(self.run_id).data.tags:
            self.client.delete_tag(self.run_id, "failure")  # a resumed run that failed before
        self.client.set_terminated(self.run_id, status=status)


def _existing_run_experiment(client, run_id: str) -> str | None:
    """The experiment id of run ``run_id``; None when the store answers that it does not
    exist. Any other failure is one :class:`HarnessError` line (not a new run)."""

    try:
        return client.get_run(run_id).info.experiment_id
    except MlflowException as err:
        if err.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return None
        cause: Exception = err
    except Exception as err:  # e.g. sqlalchemy's OperationalError: database is locked
        cause = err
    text = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ""
    raise HarnessError(
        f"cannot look up run '{run_id}' in the tracking store {tracking_uri()}: "
        f"{type(cause).__name__}: {text}"
    ) from cause


def _model_requirements() -> list[str]:
    """The pip requirements a logged model names (MLflow would otherwise load the model in
    a subprocess to infer them): torch, mlflow and this package at their versions."""
    return model_requirements(*([f"dml-harness=={v}"] if (v := harness_version()) else []))
