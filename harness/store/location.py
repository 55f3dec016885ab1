"""Where the tracking store is: its URI, its artifact folder and the paths no output may take.

Default store ``sqlite:///results/mlflow.db`` (relative to the working directory)
unless ``MLFLOW_TRACKING_URI`` is set. A SQLite store keeps its artifacts in the folder
``mlartifacts`` beside the database file (``results/mlartifacts`` for the default store):
the two are one store, and copying or moving that pair keeps every table
(:func:`artifact_root`; :func:`harness.store.queries.run_artifact_dir` reads artifacts
from there, not from the absolute location MLflow recorded).
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.base.errors import HarnessError
from harness.base.paths import ReservedPath
from harness.store.artifacts import ARTIFACT_FOLDER

__all__ = [
    "DEFAULT_URI",
    "DEFAULT_STORAGE",
    "ARTIFACT_FOLDER",
    "tracking_uri",
    "sqlite_database",
    "artifact_root",
    "reserved_paths",
]

DEFAULT_URI = "sqlite:///results/mlflow.db"
#: The Optuna studies' database of ``tune`` and ``sweep`` when ``--storage`` and
#: ``$DML_HARNESS_OPTUNA_STORAGE`` name none.
DEFAULT_STORAGE = "sqlite:///results/optuna.db"


def _setting() -> str:
    """``MLFLOW_TRACKING_URI``, else :data:`DEFAULT_URI`; the variable set but empty (or
    blank) is one error line: it names no store, and no store is guessed for it."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        return DEFAULT_URI
    if not uri.strip():
        raise HarnessError(
            f"MLFLOW_TRACKING_URI is set but empty: expected a tracking store such as "
            f"{DEFAULT_URI} or http://host:5000 (unset it for {DEFAULT_URI})"
        )
    return uri


def tracking_uri() -> str:
    """The store's URI; a SQLite store's folder is created (a relative path's only: an
    absolute one names a store that should exist). A database path that is a folder, or
    under a file, is one error line naming ``MLFLOW_TRACKING_URI``."""
    uri = _setting()
    database = sqlite_database(uri)
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


def sqlite_database(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


def artifact_root() -> Path:
    """The store's artifact folder (absolute): ``mlartifacts`` beside the SQLite database
    file, so that the store moves as one; for any other store (a server, a database
    elsewhere) ``results/mlartifacts`` under the working directory."""
    database = sqlite_database(tracking_uri())
    if database is not None:
        return (database.parent / ARTIFACT_FOLDER).resolve()
    return (Path("results") / ARTIFACT_FOLDER).resolve()


def reserved_paths() -> tuple[ReservedPath, ...]:
    """The places of the tracking store that no output may take (``--json``, ``--out``,
    figures, checkpoints): a SQLite store's database file and its artifact folder, a file
    store's folder. Computed from ``MLFLOW_TRACKING_URI`` alone: nothing is created."""
    uri = _setting()
    database = sqlite_database(uri)
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
