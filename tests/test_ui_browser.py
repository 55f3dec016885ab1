"""The MLflow UI as a new user meets it, in a real browser: ``python -m harness ui`` on a
store made by a short ``run --methods plain,diml``, its printed runs page and one run
page opened in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven
by selenium with the driver's path given, so nothing is downloaded).

The screenshots (``runs.png``, ``charts.png``, ``run.png``) go to ``results/ui-screenshots/``
(git-ignored) for a person to look at.
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

from harness.base.metric_keys import HEADLINE, metric_key
from harness.cli.main import main
from harness.store.ui import ML_VIEW_QUERY, RUN_NOTE_TAG

SCREENSHOTS = Path(__file__).resolve().parents[1] / "results" / "ui-screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
REGISTERED = "ui-browser-embedder"

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


def _wait_for(url: str, server: subprocess.Popen, log: Path, timeout: float = 180) -> None:
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
        "--window-size=2400,1300",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _page_text(driver, expected: list[str], timeout: float = 90) -> str:
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


def test_the_runs_page_and_a_run_page_show_what_a_researcher_looks_for(
    workdir, tiny_protocol, browser
):
    out = workdir / "records.json"
    assert (
        main(
            [
                "run",
                "--methods",
                "plain,diml",
                "--protocol",
                str(tiny_protocol),
                "--experiment",
                f"ui-browser-{time.time_ns()}",
                "--json",
                str(out),
                "--register",
                REGISTERED,
            ]
        )
        == 0
    )
    records = {r["method"]: r for r in json.loads(out.read_text())}

    plain = mlflow.MlflowClient().get_run(records["plain"]["mlflow_run_id"])
    port, log = _free_port(), workdir / "ui.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness",
                "ui",
                "--port",
                str(port),
                "--experiment",
                mlflow.MlflowClient().get_experiment(plain.info.experiment_id).name,
            ],
            cwd=workdir,
            env=dict(os.environ),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(f"http://127.0.0.1:{port}/health", server, log)
        printed = re.findall(r"http://127\.0\.0\.1:\d+/\S+", log.read_text())
        runs_page = printed[0]
        assert (
            f"/#/experiments/{plain.info.experiment_id}/runs?" in runs_page
            and ML_VIEW_QUERY in runs_page
        )
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)

        browser.get(runs_page)
        p_at_1 = metric_key("test", HEADLINE[0])
        # The page fills in steps (runs, then their models): wait for every part.
        text = _page_text(
            browser,
            [
                "plain-margin-seed0",
                "diml-margin-seed0",
                p_at_1,
                "synthetic (",
                "python -m harness run",
                REGISTERED,
            ],
        )  # Source and Models columns
        browser.save_screenshot(str(SCREENSHOTS / "runs.png"))
        assert "Model training" in text and ML_VIEW_QUERY in browser.current_url
        assert all(name in text for name in ("Run Name", "Dataset", "Source", "Models"))
        assert f"{records['plain']['metrics']['precision_at_1']:.4g}"[:5] in text  # a P@1 value

        browser.get(
            f"{runs_page}&compareRunsMode=CHART"
        )  # the charts, one section per metric group
        text = _page_text(browser, ["plain-margin-seed0", "\ntest\n", "\nval\n"])
        browser.save_screenshot(str(SCREENSHOTS / "charts.png"))
        assert {"test", "val", "train"} <= set(text.splitlines())  # the sections' headings

        browser.get(runs_page.split("/runs?")[0] + f"/runs/{plain.info.run_id}?{ML_VIEW_QUERY}")
        note_heading = plain.data.tags[RUN_NOTE_TAG].splitlines()[0].replace("*", "")
        text = _page_text(
            browser,
            [
                "plain-margin-seed0",
                "Description",
                note_heading,
                "embedder",
                "python -m harness run",
                p_at_1,
            ],
        )
        browser.save_screenshot(str(SCREENSHOTS / "run.png"))
        assert "P@1" in text and "MAP@R" in text
    finally:
        server.terminate()
        server.wait(timeout=60)
