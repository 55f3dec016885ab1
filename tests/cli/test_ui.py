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
    """``ui`` runs the server in its process group and, on SIGTERM, stops it and its workers."""
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


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the processes")
def test_a_sigkill_of_the_ui_process_group_ends_the_server_and_its_workers(tmp_path):
    """A supervisor that SIGKILLs ``ui``'s process group (no handler runs) leaves no server
    or worker holding the port: they are in that group."""
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom harness.cli.processes import serve_process_group\n"
            "sys.exit(serve_process_group([sys.executable, '-c', sys.argv[1], sys.argv[2]]))",
            STAND_IN,
            str(tmp_path),
        ],
        start_new_session=True,  # its own group, as a shell or a supervisor starts it
    )
    try:
        deadline = time.time() + 60
        while not ((tmp_path / "server.pid").exists() and (tmp_path / "worker.pid").exists()):
            assert supervisor.poll() is None
            assert time.time() < deadline, "the stand-in server did not start"
            time.sleep(0.05)
        time.sleep(0.1)
        pids = {int((tmp_path / name).read_text()) for name in ("server.pid", "worker.pid")}
        assert all(_alive(p) for p in pids)
        os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait(timeout=30)
        assert _wait_gone(pids, timeout=10) == set(), "processes left after SIGKILL of the group"
    finally:
        for name in ("server.pid", "worker.pid"):
            if (tmp_path / name).exists():
                try:
                    os.kill(int((tmp_path / name).read_text() or 0), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass


@pytest.mark.slow
def test_ui_lists_the_runs_through_its_rest_api(workdir):
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])  # the server reads the same
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


def test_the_pages_are_printed_and_opened_once_the_server_answers(monkeypatch, capsys):
    """``ui`` prints the pages (and with ``--open`` opens the first) once a request to the
    server succeeds, not before; nothing when the server's process ends first."""
    import http.server
    import threading
    import webbrowser

    from harness.cli.ui_command import announce_when_up

    opened = []
    monkeypatch.setattr(webbrowser, "open", opened.append)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    pages = [("tiny", f"{base}/#/experiments/1/runs?workflowType=machine_learning")]
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    done = []
    waiting = threading.Thread(
        target=lambda: done.append(
            announce_when_up(base, pages, server, open_first=True, every=0.1)
        )
    )
    waiting.start()
    try:
        time.sleep(1.5)
        assert done == [] and opened == [] and "ready" not in capsys.readouterr().err

        class Healthy(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # the handler's name is http.server's
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        http_server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Healthy)
        threading.Thread(target=http_server.serve_forever, daemon=True).start()
        try:
            waiting.join(timeout=20)
        finally:
            http_server.shutdown()
            http_server.server_close()
    finally:
        server.kill()
        server.wait()
    assert done == [True] and opened == [pages[0][1]]
    assert capsys.readouterr().err.splitlines() == ["MLflow UI ready:", f"  tiny: {pages[0][1]}"]
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert announce_when_up(f"http://127.0.0.1:{_free_port()}", pages, ended) is False
    assert capsys.readouterr().err == ""


def test_the_server_serves_artifacts_beside_the_store_through_the_harness_application(
    workdir,
):
    """``mlflow server`` runs the harness's application (an ``mlflow.app`` entry point the
    server's environment declares) and serves ``mlflow-artifacts:`` from the folder beside
    the database."""
    from importlib.metadata import distributions

    from harness.store.artifacts import PROXIED_ROOT
    from harness.store.location import artifact_root
    from harness.store.ui_server import APP_NAME, server_command, server_environment

    command = server_command("127.0.0.1", 5000)
    assert command[1:4] == ["-m", "mlflow", "server"] and "--serve-artifacts" in command
    assert command[command.index("--artifacts-destination") + 1] == artifact_root().as_uri()
    assert command[command.index("--default-artifact-root") + 1] == PROXIED_ROOT
    assert command[command.index("--app-name") + 1] == APP_NAME
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--workers") + 1] == "1"
    with server_environment() as env:
        assert env["MLFLOW_TRACKING_URI"] == os.environ["MLFLOW_TRACKING_URI"]
        path = env["PYTHONPATH"].split(os.pathsep)
        found = [
            entry
            for dist in distributions(path=path[:1])
            for entry in dist.entry_points
            if entry.group == "mlflow.app"
        ]
        assert [(e.name, e.value) for e in found] == [(APP_NAME, "harness.store.ui_app:app")]
        assert str(Path(__file__).resolve().parents[2]) in path  # this harness's source
        folder = Path(path[0])
    assert not folder.exists()  # gone with the server


def test_the_index_page_sets_the_defaults_unless_the_browser_chose(workdir):
    """The application rewrites only ``GET /`` (the UI's one page): the script that sets
    the workflow, and each experiment's runs page in its saved view, where the browser
    holds none, goes first in the head; the length follows, and the request cannot be
    answered "not modified" from a page cached without it."""
    import asyncio

    from harness.store import ui_app
    from harness.store.runs_view import VERSION_FIELD, view_state, view_tag

    client = mlflow.MlflowClient()
    state = view_state(["test/1_precision_at_1", "val/3_mean_average_precision_at_r"])
    state["selectedColumns"].append("tags.`<script>`")  # no tag may close the script
    viewed = client.create_experiment(f"viewed-{time.time_ns()}", tags=dict([view_tag(state)]))
    plain = client.create_experiment(f"plain-{time.time_ns()}")
    page = b"<html><head><title>MLflow</title></head><body></body></html>"
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/html; charset=utf-8"),
                    (b"content-length", str(len(page)).encode()),
                    (b"etag", b"x"),
                    (b"x-frame-options", b"SAMEORIGIN"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": page})

    def request(path: str) -> list[dict]:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "GET",
            "path": path,
            "headers": [(b"if-none-match", b"x"), (b"host", b"127.0.0.1")],
        }
        asyncio.run(ui_app.app(scope, None, send))
        return sent

    original = ui_app.mlflow_app
    ui_app.mlflow_app = inner
    try:
        start, body = request("/")
        assert seen[-1]["headers"] == [(b"host", b"127.0.0.1")]
        other = request("/static-files/x.js")
    finally:
        ui_app.mlflow_app = original
    html = body["body"]
    assert html.startswith(b"<html><head><script>") and html.endswith(page[len(b"<html><head>") :])
    script = html[len(b"<html><head><script>") : html.index(b"</script>")].decode()
    assert "<" not in script and "getItem(k)===null" in script  # a choice the browser holds stays
    entries = json.loads(script.split("d=", 1)[1].split(";for", 1)[0])
    assert json.loads(entries[ui_app.WORKFLOW_KEY]) == ui_app.WORKFLOW
    seeded = json.loads(entries[ui_app.runs_page_key(viewed)])
    assert seeded == {k: v for k, v in state.items() if k != VERSION_FIELD}
    assert ui_app.runs_page_key(plain) not in entries
    assert (
        ui_app.runs_page_key("7")
        == 'MLflowLocalStorage-1.1-ExperimentPage-["7"]-ReactComponentState'
    )
    headers = dict(start["headers"])
    assert headers[b"content-length"] == str(len(html)).encode()
    assert b"etag" not in headers and headers[b"x-frame-options"] == b"SAMEORIGIN"
    assert other[1]["body"] == page and dict(other[0]["headers"])[b"etag"] == b"x"
    assert seen[-1]["headers"][0] == (b"if-none-match", b"x")  # other paths: as sent


def test_a_view_the_harness_wrote_earlier_is_renewed_and_a_saved_one_kept():
    from harness.store.runs_view import VERSION, VERSION_FIELD, outdated, view_state, view_tag

    def envelope(state) -> str:
        return json.dumps({"name": "v", "createdAt": 1, "state": json.dumps(state)})

    assert outdated(None)
    first = {"selectedColumns": ["metrics.`test/1_precision_at_1`"], "orderByKey": "x"}
    assert outdated(envelope(first))  # the harness's first form, without a version
    assert outdated(envelope({**first, VERSION_FIELD: VERSION - 1}))
    assert not outdated(view_tag()[1])
    fitted = view_state(["test/1_precision_at_1", "explain/group1_mass_head"])
    assert outdated(view_tag()[1], fitted) and not outdated(view_tag(fitted)[1], fitted)
    saved = {**first, "runsPinned": [], "compareRunCharts": []}  # saved from the UI
    assert not outdated(envelope(saved)) and not outdated(envelope(saved), fitted)
    assert not outdated(json.dumps({"name": "v", "createdAt": 1, "state": "compressed"}))


def test_runs_recorded_earlier_get_display_copies_colours_and_a_fitted_view(workdir):
    """``ui`` gives a finished run recorded without them the display copies of its headline
    test metrics and of its validation curves (per epoch), once; each run a colour of its
    own (a colour a run has stays); and the experiment the view of its runs' metrics."""
    from harness.store.runs_view import HEADLINE_SECTION, TAG_PREFIX, VIEW_KEY, view_tag
    from harness.store.ui_runs import COLOUR_TAG, PALETTE, prepare_runs

    client = mlflow.MlflowClient()
    experiment = client.create_experiment(f"display-{time.time_ns()}", tags=dict([view_tag()]))
    old = client.create_run(experiment, tags={"method": "plain", "seed": "0"}).info.run_id
    client.log_metric(old, metric_key("test", "precision_at_1"), 0.459027777, step=2)
    client.log_metric(old, metric_key("test", "nmi"), 0.6442)
    for epoch, value in ((1, 0.1), (2, 0.2049)):
        client.log_metric(old, metric_key("val", "mean_average_precision_at_r"), value, step=epoch)
    client.log_metric(old, metric_key("val", "r_precision"), 0.3, step=1)
    client.set_terminated(old)
    running = client.create_run(experiment, tags={"method": "agrouping", "seed": "0"}).info.run_id
    client.log_metric(running, metric_key("test", "nmi"), 0.5)
    coloured = client.create_run(experiment, tags={COLOUR_TAG: PALETTE[0]}).info.run_id
    assert prepare_runs(experiment) == {"copies": 1, "colours": 2, "notes": 0}
    assert prepare_runs(experiment) == {"copies": 0, "colours": 0, "notes": 0}  # once
    metrics = client.get_run(old).data.metrics
    assert metrics["P at 1"] == 45.9 and metrics["NMI"] == 64.42 and "R at 1" not in metrics
    assert metrics[metric_key("test", "precision_at_1")] == 0.459027777  # as it was
    curve = client.get_metric_history(old, "val MAP at R")
    assert [(m.step, m.value) for m in curve] == [(1, 10.0), (2, 20.49)]
    assert {k for k in metrics if "/" not in k} == {"P at 1", "NMI", "val MAP at R"}
    assert "NMI" not in client.get_run(running).data.metrics  # a run not finished
    colours = {r: client.get_run(r).data.tags[COLOUR_TAG] for r in (old, running, coloured)}
    assert colours[coloured] == PALETTE[0] and len(set(colours.values())) == 3
    assert colours[running] == PALETTE[1] and colours[old] == PALETTE[2]  # agrouping, plain
    view = client.get_experiment(experiment).tags[TAG_PREFIX + VIEW_KEY]
    state = json.loads(json.loads(view)["state"])
    names = [section["name"] for section in state["compareRunSections"]]
    assert names[0] == HEADLINE_SECTION and names[2:] == ["test", "val"]
