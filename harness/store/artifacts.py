"""Where a SQLite store's artifacts live: in the folder ``mlartifacts`` beside its database
file, recorded under MLflow's proxied scheme (``mlflow-artifacts:/<run id>/artifacts``)
rather than as absolute paths, so that the database and the folder move as one.

MLflow resolves a proxied URI through a tracking server started with
``--artifacts-destination`` (``harness ui`` starts one on the folder beside the database).
Without a server (``harness run``, tables, a notebook with the SQLite URI),
:func:`proxied_repository` resolves it to that folder: the package declares it for the
scheme as an ``mlflow.artifact_repository`` entry point, which MLflow registers in every
Python process where the harness is installed, whether or not it imports the harness
(and :func:`resolve_proxied_locally` registers it where the package is not installed).
A store moved with its folder then serves its artifacts and models from the new place,
through ``harness ui`` and in Python alike; the absolute location MLflow would record
otherwise keeps pointing at the original, which may be gone.

MLflow loads the entry point with its artifact repositories: this module imports nothing
of the harness beyond itself, and MLflow only inside its functions.
"""

from __future__ import annotations

import functools
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = [
    "ARTIFACT_FOLDER",
    "PROXIED_ROOT",
    "PROXIED_SCHEME",
    "sqlite_artifact_folder",
    "proxied_local_path",
    "proxied_repository",
    "copying_local_repository",
    "resolve_proxied_locally",
]

#: The artifact folder of a SQLite store, beside its database file.
ARTIFACT_FOLDER = "mlartifacts"
#: MLflow's scheme of artifacts a tracking server serves from its artifact destination.
PROXIED_SCHEME = "mlflow-artifacts"
#: The artifact location of the experiments the harness makes in a SQLite store: runs get
#: ``mlflow-artifacts:/<run id>/artifacts``, logged models ``mlflow-artifacts:/models/<id>/artifacts``.
PROXIED_ROOT = f"{PROXIED_SCHEME}:/"


def sqlite_artifact_folder(tracking_uri: str) -> Path | None:
    """The artifact folder (absolute) of the SQLite store ``tracking_uri``; None for any
    other store."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///").split("?", 1)[0])
    return (database.parent / ARTIFACT_FOLDER).resolve()


def proxied_local_path(artifact_uri: str, tracking_uri: str) -> Path | None:
    """The local path of proxied ``artifact_uri`` in the SQLite store ``tracking_uri``;
    None when the URI is not proxied or the store is not SQLite (a server resolves it)."""
    folder = sqlite_artifact_folder(tracking_uri)
    parsed = urlparse(artifact_uri)
    if folder is None or parsed.scheme != PROXIED_SCHEME:
        return None
    relative = unquote(parsed.path).lstrip("/")
    if ".." in Path(relative).parts:
        raise ValueError(f"artifact URI {artifact_uri!r} leaves the store's artifact folder")
    return folder / relative


def proxied_repository(
    artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None
):
    """MLflow's repository for ``artifact_uri`` (``mlflow-artifacts:``): the store's own
    folder when the tracking URI (given, else MLflow's current one) is a SQLite store, else
    MLflow's proxy client (a tracking server), as MLflow itself would give.

    The store's folder is read as a server's would be: a download goes to a folder of its
    own (:func:`copying_local_repository`), never handed out in place. MLflow writes into the
    folder a download gives it (loading ``models:/...`` adds a ``registered_model_meta``
    file there), and a load must leave the store as it was."""
    # deferred: MLflow loads this module (its entry point) while it imports its artifact
    # registry, and harness.store.location puts it on --help (mlflow: 0.7 s)
    import mlflow
    from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

    local = proxied_local_path(artifact_uri, tracking_uri or mlflow.get_tracking_uri())
    if local is None:
        return MlflowArtifactsRepository(
            artifact_uri, tracking_uri=tracking_uri, registry_uri=registry_uri
        )
    return copying_local_repository()(
        local.as_uri(), tracking_uri=tracking_uri, registry_uri=registry_uri
    )


@functools.cache
def copying_local_repository() -> type:
    """MLflow's repository of a local folder, except that a download without a destination
    copies into a temporary folder (as from a server) instead of returning the stored
    folder itself, which MLflow's model loading then writes into."""
    # deferred: as in proxied_repository, MLflow imports this module while loading these
    from mlflow.store.artifact.artifact_repo import ArtifactRepository
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    class CopyingLocalArtifactRepository(LocalArtifactRepository):
        def download_artifacts(self, artifact_path, dst_path=None):
            return ArtifactRepository.download_artifacts(self, artifact_path, dst_path)

    return CopyingLocalArtifactRepository


def resolve_proxied_locally() -> None:
    """Make this process resolve ``mlflow-artifacts:`` URIs of a SQLite store to the folder
    beside its database (writing and reading alike), and leave them to MLflow's proxy
    client for a tracking server. Idempotent.

    MLflow's artifact-repository registry maps a URI scheme to the class that serves it
    (plugins register theirs the same way); its own class for this scheme needs an HTTP
    tracking URI and fails on a SQLite one."""
    # deferred: the registry's module loads this module (its entry point) while it is imported
    from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry

    _artifact_repository_registry.register(PROXIED_SCHEME, proxied_repository)
