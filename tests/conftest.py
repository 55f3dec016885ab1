"""Shared fixtures: an isolated data root, tracking store and working directory per session."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
TINY_PROTOCOL = TESTS / "protocols" / "tiny.toml"

# Never reach for a model hub from tests (timm would retry for ~30 s).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Runs skip the logged MLflow model (torch.export: about half of a tiny run's time); the
# tests of the logged model ask for it with the `logged_models` fixture or the setting.
os.environ.setdefault("DML_HARNESS_LOG_MODEL", "0")
# Commands start without the warm-up and its estimate (about a second per method): the tests
# of the estimate ask for it with the `estimates` fixture, and one test measures every
# registered method's warm-up (tests/cli/test_run_estimate.py).
os.environ.setdefault("DML_HARNESS_ESTIMATE", "0")


@pytest.fixture(autouse=True)
def tracking_uri_follows_the_environment():
    """After each test, MLflow's process-wide tracking URI is the environment's again.

    ``mlflow.set_tracking_uri`` (called by each command) keeps the URI in a module global that
    outlives a test's ``monkeypatch`` of ``MLFLOW_TRACKING_URI``; a later test's
    ``MlflowClient()`` would otherwise open an earlier test's store, which may since have
    been moved (SQLite then answers "attempt to write a readonly database")."""
    yield
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        # None (no URI in the environment) leaves MLflow reading the environment again
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI"))


@pytest.fixture(scope="session", autouse=True)
def cache_folder(tmp_path_factory) -> Path:
    """The harness's cache (the kept ``methods`` lines of installed plugins) is the session's."""
    path = tmp_path_factory.mktemp("cache")
    os.environ["DML_HARNESS_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """A data root shared by the session; the synthetic dataset is generated here once."""
    root = tmp_path_factory.mktemp("data")
    os.environ["DML_HARNESS_DATA"] = str(root)
    return root


@pytest.fixture(scope="session")
def tracking_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tracking")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{path / 'mlflow.db'}"
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch, data_root, tracking_dir) -> Path:
    """Run inside a fresh folder so ``results/`` (checkpoints, artifacts) is private."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_protocol() -> Path:
    return TINY_PROTOCOL


@pytest.fixture
def experiment(workdir) -> str:
    """A fresh experiment name in the session's tracking store, MLflow pointed at it."""
    import mlflow

    from harness.store.location import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    return f"tables-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def logged_models(monkeypatch) -> None:
    """Runs log their embedder as an MLflow model, as they do outside the tests."""
    monkeypatch.setenv("DML_HARNESS_LOG_MODEL", "1")


@pytest.fixture
def estimates(monkeypatch) -> None:
    """``run`` and ``sweep`` measure their warm-up and print their estimate, as they do
    outside the tests."""
    monkeypatch.setenv("DML_HARNESS_ESTIMATE", "1")
