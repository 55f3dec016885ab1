"""What ``python -m harness ui`` serves: MLflow's tracking server over the project's store,
with its artifacts from the folder beside a SQLite database, the model-training view at
every address, and each experiment's runs ready for the saved view *Metric learning*.

The MLflow UI picks its workflow (model training, or generative AI: traces) from the URL
parameter ``workflowType``, else from the browser's ``localStorage`` key
``mlflow.workflowType_v1``, else generative AI; the experiment's kind tag is not read
while workflow navigation is on (MLflow 3.17: ``mlflow/server/js/build/static/js/main.*.js``,
the provider of ``mlflow.workflowType``). So the server runs :mod:`harness.store.ui_app`,
MLflow's own application whose index page sets that key to model training unless the
browser already holds a choice, through MLflow's ``--app-name`` option: an application
named by an ``mlflow.app`` entry point, which :func:`server_environment` declares in a
folder of its own on the server's ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from harness.store.artifacts import PROXIED_ROOT
from harness.store.location import artifact_root, tracking_uri

__all__ = ["APP_NAME", "WORKERS", "server_command", "server_environment"]

#: The name of the harness's application for ``mlflow server --app-name``.
APP_NAME = "dml-harness-ui"
_APP = "harness.store.ui_app:app"
#: The server's worker processes: one serves a person's browser, and each imports MLflow
#: before the server answers (measured on 2 busy cores: 54 s to the first answer with one
#: worker, 113 s with MLflow's default of 4).
WORKERS = 1


def server_command(host: str, port: int) -> list[str]:
    """The ``mlflow server`` command line of the UI over the tracking store: the harness's
    application (:data:`APP_NAME`) in :data:`WORKERS` worker, serving artifacts
    (``mlflow-artifacts:`` URIs) from :func:`harness.store.location.artifact_root`, where
    :mod:`harness.store.artifacts` puts them."""
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        tracking_uri(),
        "--serve-artifacts",
        "--artifacts-destination",
        artifact_root().as_uri(),
        "--default-artifact-root",
        PROXIED_ROOT,
        "--app-name",
        APP_NAME,
        "--workers",
        str(WORKERS),
        "--host",
        host,
        "--port",
        str(port),
    ]


@contextlib.contextmanager
def server_environment() -> Iterator[dict[str, str]]:
    """The environment of the server process while it runs: ``PYTHONPATH`` leads with a
    temporary folder declaring :data:`APP_NAME` (an ``mlflow.app`` entry point in a
    ``.dist-info`` folder, as an installed package declares one) and with the folder this
    harness is imported from, so that the server's workers import the same code;
    ``MLFLOW_TRACKING_URI`` names the store, which the application reads the experiments'
    saved views from (:mod:`harness.store.ui_app`)."""
    with tempfile.TemporaryDirectory(prefix="harness-ui-") as folder:
        info = Path(folder) / "dml_harness_ui-1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dml-harness-ui\nVersion: 1\n")
        (info / "entry_points.txt").write_text(f"[mlflow.app]\n{APP_NAME} = {_APP}\n")
        source = str(Path(__file__).resolve().parents[2])
        path = [folder, source, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        yield {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(path),
            "MLFLOW_TRACKING_URI": tracking_uri(),
        }
