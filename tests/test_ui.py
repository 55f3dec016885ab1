"""``python -m harness ui``: the MLflow UI over the project's store, bound to 127.0.0.1,
lists the runs (checked through its REST API)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import mlflow
import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_ui_lists_the_runs_through_its_rest_api(workdir):
    client = mlflow.MlflowClient()
    experiment = client.create_experiment(f"ui-{time.time_ns()}")
    run_ids = set()
    for method in ("ngrouping", "agrouping"):  # what a grid's cells leave in the store
        run = client.create_run(experiment, tags={"method": method, "grid": "ui-test"})
        client.log_metric(run.info.run_id, "test_precision_at_1", 0.5)
        client.set_terminated(run.info.run_id)
        run_ids.add(run.info.run_id)

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "harness", "ui", "--port", str(port)], cwd=workdir,
                              env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, found = time.time() + 120, None
        while time.time() < deadline:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            try:
                found = _post(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
                              {"experiment_ids": [experiment], "filter": "tags.grid = 'ui-test'"})
                break
            except OSError:
                time.sleep(1)
        assert found is not None, "the UI did not answer within 120 s"
        assert {r["info"]["run_id"] for r in found["runs"]} == run_ids
    finally:
        server.terminate()
        server.wait(timeout=30)
