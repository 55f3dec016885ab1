"""``python -m harness ui``: the MLflow UI over the project's store, bound to 127.0.0.1,
lists the runs (checked through its REST API); stopped with SIGTERM, it leaves no
server process or worker behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest

from harness.base.metric_keys import metric_key


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _wait_gone(pids, timeout: float = 30) -> set[int]:
    deadline = time.time() + timeout
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


# A stand-in for `mlflow server`: a process that starts a worker of its own (the grandchild
# of the harness), each writing its pid, then both wait.
STAND_IN = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    folder = Path(sys.argv[1])
    child = f"import os, time; open({str(folder / 'worker.pid')!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", child])
    (folder / "server.pid").write_text(str(__import__("os").getpid()))
    time.sleep(600)
""")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the processes")
def test_sigterm_stops_the_server_and_its_workers(tmp_path):
    """``ui`` runs the server in its own process group and, on SIGTERM, stops the group."""
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom harness.cli.processes import serve_process_group\n"
            "try:\n    sys.exit(serve_process_group([sys.executable, '-c', sys.argv[1], sys.argv[2]], grace=5))\n"
            "except KeyboardInterrupt:\n    sys.exit(130)",
            STAND_IN,
            str(tmp_path),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while not ((tmp_path / "server.pid").exists() and (tmp_path / "worker.pid").exists()):
            assert supervisor.poll() is None, supervisor.stderr.read()
            assert time.time() < deadline, "the stand-in server did not start"
            time.sleep(0.05)
        time.sleep(0.1)  # the pid files are written before they are closed
        pids = {int((tmp_path / name).read_text()) for name in ("server.pid", "worker.pid")}
        assert all(_alive(p) for p in pids)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=30) == 130
        assert _wait_gone(pids, timeout=5) == set(), "processes left running after SIGTERM"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        for name in ("server.pid", "worker.pid"):
            if (tmp_path / name).exists():
                try:
                    os.kill(int((tmp_path / name).read_text() or 0), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass


@pytest.mark.slow
def test_ui_lists_the_runs_through_its_rest_api(workdir):
    client = mlflow.MlflowClient()
    experiment = client.create_experiment(f"ui-{time.time_ns()}")
    run_ids = set()
    for method in ("ngrouping", "agrouping"):  # what a grid's cells leave in the store
        run = client.create_run(experiment, tags={"method": method, "grid": "ui-test"})
        client.log_metric(run.info.run_id, metric_key("test", "precision_at_1"), 0.5)
        client.set_terminated(run.info.run_id)
        run_ids.add(run.info.run_id)

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "harness", "ui", "--port", str(port)],
        cwd=workdir,
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline, found = time.time() + 120, None
        while time.time() < deadline:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            try:
                found = _post(
                    f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
                    {"experiment_ids": [experiment], "filter": "tags.grid = 'ui-test'"},
                )
                break
            except OSError:
                time.sleep(1)
        assert found is not None, "the UI did not answer within 120 s"
        assert {r["info"]["run_id"] for r in found["runs"]} == run_ids
        started = _descendants(server.pid)  # mlflow server and the workers it started
        assert started
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode == 130
    assert _wait_gone(started) == set(), "the MLflow server or a worker outlived SIGTERM"


def test_an_unknown_experiment_is_one_error_line(workdir, capsys):
    from harness.cli.main import main

    assert main(["ui", "--experiment", f"no-such-{time.time_ns()}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: no experiment 'no-such-")


def test_open_waits_for_the_server_then_opens_the_runs_page(monkeypatch):
    """``ui --open`` opens the page once the server answers, not before (a thread)."""
    import http.server
    import threading
    import webbrowser

    from harness.cli.listings import _open_when_up

    opened = []
    monkeypatch.setattr(webbrowser, "open", opened.append)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/#/experiments/1/runs?workflowType=machine_learning"
    _open_when_up(f"http://127.0.0.1:{port}", url, timeout=30)
    time.sleep(1.5)
    assert opened == []  # nothing answers yet

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name is http.server's
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        deadline = time.time() + 20
        while not opened and time.time() < deadline:
            time.sleep(0.1)
    finally:
        server.shutdown()
        server.server_close()
    assert opened == [url]
