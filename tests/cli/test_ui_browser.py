"""The MLflow UI as a researcher meets it, in a real browser: ``python -m harness ui`` on a
store made by a short ``run --methods plain,agrouping,diml``, opened in headless Chromium
at 1400 x 1000 (Debian's ``chromium`` and ``chromium-driver``, driven by selenium with the
driver's path given, so nothing is downloaded) with a fresh profile.

Every address a user may type, the bare one, an experiment's, a run's, a logged model's
and the compare page, shows the model-training sidebar; the printed runs page shows the
method, dataset and headline metrics of each run without scrolling, best P@1 first, in %
with two decimals; its charts open on the ``test`` section.

The screenshots go to ``$DML_HARNESS_SCREENSHOTS``, else ``results/ui-screenshots/``
(git-ignored), for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest

from harness.base.metric_keys import HEADLINE, READABLE
from harness.cli.main import main
from harness.store.ui import ML_VIEW_QUERY, RUN_NOTE_TAG
from harness.store.ui_app import WORKFLOW, WORKFLOW_KEY

SCREENSHOTS = Path(
    os.environ.get("DML_HARNESS_SCREENSHOTS")
    or Path(__file__).resolve().parents[2] / "results" / "ui-screenshots"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
REGISTERED = "ui-browser-embedder"
WIDTH, HEIGHT = 1400, 1000

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs chromium and its driver (Debian: apt install chromium chromium-driver)",
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(url: str, server: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"the UI did not answer at {url} within {timeout:.0f} s")


@pytest.fixture
def browser():
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="needs selenium (pip install selenium)"
    )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH},{HEIGHT}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _page_text(driver, expected: list[str], timeout: float = 120) -> str:
    """The page's text once every string of ``expected`` is in it (the UI loads in steps)."""
    from selenium.webdriver.common.by import By

    deadline, text = time.time() + timeout, ""
    while time.time() < deadline:
        text = driver.find_element(By.TAG_NAME, "body").text
        if all(e in text for e in expected):
            return text
        time.sleep(1)
    missing = [e for e in expected if e not in text]
    raise AssertionError(f"not on the page after {timeout:.0f} s: {missing}\n{text[:3000]}")


def _open(driver, url: str, expected: list[str], shot: str, ready=None) -> str:
    """Open ``url``, wait for ``expected`` (and ``ready(driver)``), save screenshot
    ``shot`` and check the sidebar is model training's: its Model registry link, which the
    generative-AI sidebar lacks, and the browser's stored workflow."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    text = _page_text(driver, ["Model training", *expected])
    deadline = time.time() + 120
    while ready is not None and not ready(driver):
        assert time.time() < deadline, f"{shot}: not drawn within 120 s"
        time.sleep(1)
    time.sleep(2)  # the last requests of the page settle
    text = driver.find_element(By.TAG_NAME, "body").text
    driver.save_screenshot(str(SCREENSHOTS / shot))
    registry = driver.find_elements(By.XPATH, "//a[normalize-space(.)='Model registry']")
    assert registry and registry[0].is_displayed(), f"{shot}: not the model-training sidebar"
    stored = driver.execute_script(f"return window.localStorage.getItem('{WORKFLOW_KEY}')")
    assert json.loads(stored) == WORKFLOW, shot
    return text


def _grid(driver) -> dict:
    """The runs table as the browser lays it out: the visible box of the grid, each header
    cell's box by its label, and each row's cells (text and box) by column id, top row
    first."""
    return driver.execute_script(
        """
        const box = e => { const r = e.getBoundingClientRect();
                           return {left: r.left, right: r.right, width: r.width}; };
        const root = document.querySelector('.ag-root-wrapper');
        const headers = {};
        for (const h of document.querySelectorAll('.ag-header-cell')) {
            const label = h.innerText.trim();
            if (label) headers[label] = box(h);
        }
        const rows = {};
        for (const c of document.querySelectorAll('.ag-row[row-index] .ag-cell[col-id]')) {
            const index = c.closest('.ag-row').getAttribute('row-index');
            rows[index] = rows[index] || {};
            rows[index][c.getAttribute('col-id')] = {text: c.innerText.trim(), box: box(c)};
        }
        return {grid: box(root), window: window.innerWidth, headers: headers,
                rows: Object.keys(rows).sort((a, b) => a - b).map(k => rows[k])};
        """
    )


def _within(cell: dict, layout: dict) -> bool:
    """Whether a cell's box lies inside the grid's visible box and the window."""
    box, grid = cell["box"] if "box" in cell else cell, layout["grid"]
    return (
        box["width"] > 0
        and box["left"] >= grid["left"] - 1
        and box["right"] <= min(grid["right"], layout["window"]) + 1
    )


def test_every_address_opens_model_training_and_the_view_ranks_the_methods(
    workdir, tiny_protocol, browser, logged_models
):
    out, experiment = workdir / "records.json", f"ui-browser-{time.time_ns()}"
    assert (
        main(
            [
                "run",
                "--methods",
                "plain,agrouping,diml",
                "--protocol",
                str(tiny_protocol),
                "--experiment",
                experiment,
                "--json",
                str(out),
                "--register",
                REGISTERED,
            ]
        )
        == 0
    )
    records = {r["method"]: r for r in json.loads(out.read_text())}
    client = mlflow.MlflowClient()
    runs = {m: client.get_run(r["mlflow_run_id"]) for m, r in records.items()}
    experiment_id = runs["plain"].info.experiment_id

    port, log = _free_port(), workdir / "ui.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "harness", "ui", "--port", str(port)]
            + ["--experiment", experiment],
            cwd=workdir,
            env=dict(os.environ),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for(f"{base}/health", server, log)
        runs_page = re.findall(r"http://127\.0\.0\.1:\d+/\S+", log.read_text())[0]
        assert f"/#/experiments/{experiment_id}/runs?" in runs_page and ML_VIEW_QUERY in runs_page
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        _check_bare_addresses(browser, base, experiment)
        _check_the_view(browser, runs_page, records)
        _check_the_charts(browser, runs_page, records)
        _check_the_run_and_its_model(browser, base, runs["plain"])
        ids = json.dumps([r.info.run_id for r in runs.values()]).replace(" ", "")
        _open(
            browser,
            f'{base}/#/compare-runs?runs={ids}&experiments=["{experiment_id}"]',
            ["Comparing 3 Runs", "plain-margin-seed0"],
            "compare.png",
        )
    finally:
        server.terminate()
        server.wait(timeout=60)


def _check_bare_addresses(browser, base: str, experiment: str) -> None:
    """The bare address (MLflow's home) and an experiment's address without parameters."""
    _open(browser, f"{base}/", ["Experiments", experiment], "home.png")
    experiment_id = mlflow.get_experiment_by_name(experiment).experiment_id
    _open(
        browser,
        f"{base}/#/experiments/{experiment_id}",
        ["Runs", "plain-margin-seed0"],
        "experiment.png",
    )


def _check_the_view(browser, runs_page: str, records: dict) -> None:
    """The printed runs page: run name, method, dataset, loss, seed and the headline
    metrics visible without scrolling at 1400 px, in % with two decimals, best P@1 first;
    no Source or Models column."""
    names = [READABLE[m] for m in HEADLINE]
    text = _open(
        browser, runs_page, [*names, "method", "dataset", "agrouping-margin-seed0"], "runs.png"
    )
    layout = _grid(browser)
    for label in ["Run Name", "method", "dataset", "loss", "seed", *names]:
        assert label in layout["headers"] and _within(layout["headers"][label], layout), label
    assert "Source" not in layout["headers"] and "Models" not in layout["headers"]
    best = max(records.values(), key=lambda r: r["metrics"]["precision_at_1"])
    # A run name's cell holds its colour's label, then the name.
    order = [row["attributes.`Run Name`"]["text"].splitlines()[-1] for row in layout["rows"]]
    assert order[0] == f"{best['method']}-margin-seed0", order
    for row in layout["rows"]:
        method = row["tags.`method`"]["text"]
        assert _within(row["tags.`method`"], layout) and _within(row["tags.`dataset`"], layout)
        assert row["tags.`dataset`"]["text"] == "synthetic"
        for name in HEADLINE:
            cell = row[f"metrics.`{READABLE[name]}`"]
            assert _within(cell, layout), (method, name)
            assert re.fullmatch(r"\d+(\.\d{1,2})?", cell["text"]), cell["text"]
            assert float(cell["text"]) == round(100 * records[method]["metrics"][name], 2)
    assert "python -m harness run" not in text  # the Source column is hidden


def _check_the_charts(browser, runs_page: str, records: dict) -> None:
    """The view's charts: the ``test`` section first, the headline metrics first in it, as
    bars of every run."""
    url = f"{runs_page}&compareRunsMode=CHART"
    text = _open(browser, url, ["\ntest\n", "\nval\n"], "charts.png", ready=_bars_drawn)
    lines = text.splitlines()
    sections = [lines[i] for i in range(len(lines) - 1) if re.fullmatch(r"\(\d+\)", lines[i + 1])]
    assert sections[0] == "test", sections
    first = lines.index("test")
    assert [line for line in lines[first:] if line in READABLE.values()][:4] == [
        READABLE[m] for m in HEADLINE
    ]
    bars = browser.execute_script(
        "return Array.from(document.querySelectorAll('.js-plotly-plot')).slice(0, 4)"
        ".map(p => p.querySelectorAll('.barlayer .point').length)"
    )
    assert bars == [len(records)] * 4, bars  # a bar per run, none hidden


def _bars_drawn(driver) -> bool:
    """Whether the first chart has drawn its bars (the charts load after the page)."""
    return bool(
        driver.execute_script(
            "const p = document.querySelector('.js-plotly-plot');"
            "return p !== null && p.querySelectorAll('.barlayer .point').length > 0"
        )
    )


def _check_the_run_and_its_model(browser, base: str, run) -> None:
    """A run's page (its description's table rendered as a table) and its logged model's
    page (named after the run, its source the harness command, its dataset)."""
    from selenium.webdriver.common.by import By

    experiment_id, run_id = run.info.experiment_id, run.info.run_id
    note_heading = run.data.tags[RUN_NOTE_TAG].splitlines()[0].replace("*", "")
    _open(
        browser,
        f"{base}/#/experiments/{experiment_id}/runs/{run_id}",
        ["Description", note_heading, "plain-synthetic-margin-seed0", "python -m harness run"],
        "run.png",
    )
    headers = [th.text.strip() for th in browser.find_elements(By.CSS_SELECTOR, "table th")]
    assert headers[:3] == ["P@1 = R@1", "MAP@R", "NMI"], headers
    model_id = run.data.tags["model_uri"].split("/")[-1]
    _open(
        browser,
        f"{base}/#/experiments/{experiment_id}/models/{model_id}",
        ["plain-synthetic-margin-seed0", "python -m harness run", "synthetic", REGISTERED],
        "model.png",
    )
    _open(
        browser,
        f"{base}/#/experiments/{experiment_id}/models",
        ["plain-synthetic-margin-seed0", "agrouping-synthetic-margin-seed0", "synthetic (#"],
        "models.png",
    )
