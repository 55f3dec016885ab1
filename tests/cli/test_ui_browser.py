"""The MLflow UI as a researcher meets it, in a real browser: ``python -m harness ui`` on a
store made by a short ``run --methods plain,agrouping,diml``, opened in headless Chromium
at 1000 and at 1400 px wide (Debian's ``chromium`` and ``chromium-driver``, driven by
selenium with the driver's path given, so nothing is downloaded), each with a fresh
profile.

- ``ui`` prints the pages once the server answers them.
- From the bare address, one click (the experiment) shows every run's method and headline
  metrics in % without scrolling sideways, best P@1 first; again after another view was
  opened.
- The charts open on the headline metrics, one dot per run above its method's name, each
  run in a colour of its own, and on the curves (validation in % per epoch, training loss,
  the loss over its first value and learning rate per step); the run's tooltip starts with plain text.
- A run's page shows its description's deviations without a click; its logged model's
  page the run's final metrics; the compare page the runs.
- A run's retrieval examples and embedding map show on its Artifacts tab; the table
  ``harness table`` logs is rendered there too, linked from the experiment's description.

The screenshots go to ``$DML_HARNESS_SCREENSHOTS``, else ``results/ui-screenshots/``
(git-ignored), ``<width>-<page>.png``, for a person to look at.
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
from harness.store.runs_view import CURVES_SECTION, HEADLINE_SECTION, VIEW_KEY
from harness.store.tables import TABLES_FOLDER
from harness.store.tracking import TABLE_SET_TAG
from harness.store.ui import ML_VIEW_QUERY, RUN_NOTE_TAG
from harness.store.ui_app import WORKFLOW, WORKFLOW_KEY
from harness.store.ui_runs import COLOUR_TAG

SCREENSHOTS = Path(
    os.environ.get("DML_HARNESS_SCREENSHOTS")
    or Path(__file__).resolve().parents[2] / "results" / "ui-screenshots"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
REGISTERED = "ui-browser-embedder"
WIDTHS, HEIGHT = (1000, 1400), 1000
#: The curves section's charts, in order.
CURVES = ("val MAP at R", "train/loss", "train/relative_loss", "train/lr")

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


def _browser(width: int):
    """Headless Chromium, a fresh profile, ``width`` x :data:`HEIGHT`, with a mouse as a
    desktop has: headless Chromium has no pointer device, and the charts would show their
    toolbars as on a touch screen, always."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="needs selenium (pip install selenium)"
    )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    # Blink's hover and pointer types: 2 = hover, 4 = fine (a mouse).
    pointer = (
        "primaryHoverType=2,availableHoverTypes=2,primaryPointerType=4,availablePointerTypes=4"
    )
    options.add_argument(f"--blink-settings={pointer}")
    options.add_argument(f"--window-size={width},{HEIGHT}")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _wait(driver, ready, what: str, timeout: float = 120):
    """``ready(driver)`` once it is truthy (the UI loads in steps)."""
    deadline = time.time() + timeout
    while True:
        value = ready(driver)
        if value:
            return value
        assert time.time() < deadline, f"{what}: not there within {timeout:.0f} s"
        time.sleep(0.5)


def _text(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def _shot(driver, width: int, page: str) -> None:
    time.sleep(1)  # the last requests of the page settle
    driver.save_screenshot(str(SCREENSHOTS / f"{width}-{page}.png"))


def _model_training(driver, page: str) -> None:
    """The sidebar is model training's (its Model registry link, which the generative-AI
    sidebar lacks), and the browser holds that workflow."""
    from selenium.webdriver.common.by import By

    registry = driver.find_elements(By.XPATH, "//a[normalize-space(.)='Model registry']")
    assert registry and registry[0].is_displayed(), f"{page}: not the model-training sidebar"
    stored = driver.execute_script(f"return window.localStorage.getItem('{WORKFLOW_KEY}')")
    assert json.loads(stored) == WORKFLOW, page


@pytest.fixture(scope="module")
def served(tmp_path_factory, data_root, tracking_dir, tiny_protocol):
    """Three runs (plain, agrouping, DIML on plain's weights; models logged and registered)
    and ``harness ui`` over them: its address, what it printed, the experiment and runs."""
    folder = tmp_path_factory.mktemp("ui-browser")
    experiment = f"ui-browser-{time.time_ns()}"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("DML_HARNESS_LOG_MODEL", "1")
        out = folder / "records.json"
        methods = ["--methods", "plain,agrouping,diml", "--protocol", str(tiny_protocol)]
        arguments = ["--experiment", experiment, "--json", str(out), "--register", REGISTERED]
        assert main(["run", *methods, *arguments]) == 0
    records = {r["method"]: r for r in json.loads(out.read_text())}
    port, log = _free_port(), folder / "ui.log"
    command = [sys.executable, "-m", "harness", "ui", "--port", str(port)]
    with log.open("w") as sink:
        server = subprocess.Popen(
            [*command, "--experiment", experiment],
            cwd=folder,
            env=dict(os.environ),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while "MLflow UI ready:" not in log.read_text():
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "the UI was not ready within 300 s"
            time.sleep(0.2)
        with urllib.request.urlopen(f"{base}/", timeout=5) as page:  # answers at once
            assert page.status == 200
        client = mlflow.MlflowClient()
        runs = {m: client.get_run(r["mlflow_run_id"]) for m, r in records.items()}
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        yield {"base": base, "log": log.read_text(), "experiment": experiment, "runs": runs}
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_ui_prints_the_pages_once_the_server_answers(served):
    lines = served["log"].splitlines()
    starting = next(i for i, line in enumerate(lines) if "starting on" in line)
    ready = lines.index("MLflow UI ready:")
    printed = [i for i, line in enumerate(lines) if "/#/experiments/" in line]
    assert starting < ready < min(printed)  # no page before the server answered
    experiment_id = served["runs"]["plain"].info.experiment_id
    page = re.findall(r"http://127\.0\.0\.1:\d+/\S+", lines[ready + 1])[0]
    assert page == f"{served['base']}/#/experiments/{experiment_id}/runs?{ML_VIEW_QUERY}"


@pytest.mark.parametrize("width", WIDTHS)
def test_the_best_method_is_one_click_from_the_bare_address(served, width):
    """Bare address, then the experiment's link: the view, best P@1 first, the headline
    columns within the window; the same after the saved view and the models page were
    opened, and from the run page's breadcrumb."""
    driver = _browser(width)
    try:
        _from_home(driver, served, width, "runs")
        experiment_id = served["runs"]["plain"].info.experiment_id
        base = f"{served['base']}/#/experiments/{experiment_id}"
        driver.get(f"{base}/runs?viewStateShareKey={VIEW_KEY}")  # Views -> Metric learning
        _wait(driver, lambda d: "P at 1" in _text(d), "the saved view")
        driver.get(f"{base}/models")
        _wait(driver, lambda d: "plain-synthetic-margin-seed0" in _text(d), "the models page")
        _shot(driver, width, "models")
        _from_home(driver, served, width, "runs-again")
    finally:
        driver.quit()


def _from_home(driver, served, width: int, shot: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{served['base']}/")
    link = _wait(
        driver,
        lambda d: d.find_elements(By.XPATH, f"//a[normalize-space(.)='{served['experiment']}']"),
        "the experiment's link on the home page",
    )
    _shot(driver, width, "home")
    link[0].click()  # the one click
    _wait(driver, lambda d: len(_grid(d)["rows"]) == len(served["runs"]), "the runs table")
    _shot(driver, width, shot)
    _model_training(driver, shot)
    layout = _grid(driver)
    names = [READABLE[m] for m in HEADLINE]
    for label in ["Run Name", *names]:
        assert label in layout["headers"] and _within(layout["headers"][label], layout), label
    assert "Source" not in layout["headers"] and "Models" not in layout["headers"]
    runs = served["runs"]
    best = max(runs, key=lambda m: runs[m].data.metrics["test/1_precision_at_1"])
    order = [row["attributes.`Run Name`"]["text"].splitlines()[-1] for row in layout["rows"]]
    assert order[0] == runs[best].info.run_name, order
    for row in layout["rows"]:
        method = row["tags.`method`"]["text"]
        for name in HEADLINE:
            cell = row[f"metrics.`{READABLE[name]}`"]
            assert _within(cell, layout), (method, name)
            assert re.fullmatch(r"\d+(\.\d{1,2})?", cell["text"]), cell["text"]
            fraction = runs[method].data.metrics[f"test/{HEADLINE.index(name) + 1}_{name}"]
            assert float(cell["text"]) == round(100 * fraction, 2)


def _grid(driver) -> dict:
    """The runs table as the browser lays it out: the visible box of the grid, each header
    cell's box by its label, and each row's cells (text and box) by column id, top row
    first."""
    return driver.execute_script(
        """
        const box = e => { const r = e.getBoundingClientRect();
                           return {left: r.left, right: r.right, width: r.width}; };
        const root = document.querySelector('.ag-root-wrapper');
        if (root === null) return {rows: []};
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


@pytest.mark.parametrize("width", WIDTHS)
def test_the_charts_open_on_the_headline_dots_and_the_curves(served, width):
    runs = served["runs"]
    experiment_id = runs["plain"].info.experiment_id
    driver = _browser(width)
    try:
        driver.get(f"{served['base']}/#/experiments/{experiment_id}/runs?compareRunsMode=CHART")
        plots = _wait(driver, lambda d: len(_plots(d)) >= 4 and _plots(d), "the headline charts")
        _shot(driver, width, "charts")
        lines = _text(driver).splitlines()
        sections = [
            (lines[i], lines[i + 1])
            for i in range(len(lines) - 1)
            if re.fullmatch(r"\(\d+\)", lines[i + 1])
        ]
        assert sections[:2] == [(HEADLINE_SECTION, "(4)"), (CURVES_SECTION, "(4)")], sections
        assert all(count != "(0)" for _, count in sections)  # no empty section
        methods = sorted(runs)
        colours = {m: runs[m].data.tags[COLOUR_TAG] for m in methods}
        assert len(set(colours.values())) == len(runs)  # a colour of its own
        for plot in plots[:4]:  # a dot per run above its method's name, in its colour
            assert sorted(plot["x"]) == methods, plot
            assert sorted(plot["colours"]) == sorted(_rgb(c) for c in colours.values())
        toolbars = driver.execute_script(
            "return Array.from(document.querySelectorAll('.modebar-group'))"
            ".map(g => getComputedStyle(g).opacity)"
        )
        assert toolbars and set(toolbars) == {"0"}  # over no run's dot until pointed at
        _tooltip(driver, runs)
        curves = _scroll_to(driver, CURVES_SECTION, "the curves")
        _shot(driver, width, "curves")
        titles = [c["title"] for c in curves]
        assert titles == list(CURVES), titles
        lr = runs["plain"].data.metrics["train/lr"]
        ticks = [float(t.replace("µ", "e-6").replace("m", "e-3")) for t in curves[3]["y"] if t]
        assert min(ticks) < lr < max(ticks), (lr, curves[3]["y"])  # the logged value, in range
    finally:
        driver.quit()


def _plots(driver) -> list[dict]:
    """The drawn charts: each one's title, x tick labels, y tick labels and dot colours."""
    return driver.execute_script(
        """
        const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
        return plots.map(p => {
          const card = p.closest('[data-testid="experiment-view-compare-runs-card"]');
          const title = card ? card.innerText.split('\\n')[0] : '';
          const ticks = axis => Array.from(p.querySelectorAll(`.${axis}tick text`))
                                     .map(t => t.textContent);
          return {title: title, x: ticks('x'), y: ticks('y'),
                  colours: Array.from(p.querySelectorAll('.scatterlayer .point'))
                                .map(d => d.style.fill)};
        });
        """
    )


def _rgb(colour: str) -> str:
    """``#0067a5`` as the browser writes it: ``rgb(0, 103, 165)``."""
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({red}, {green}, {blue})"


def _tooltip(driver, runs) -> None:
    """The tooltip of a dot names its run and starts with its description as plain text."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    dot = driver.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .scatterlayer .point")[0]
    ActionChains(driver).move_to_element(dot).perform()
    shown = _wait(
        driver,
        lambda d: [t for t in _text(d).splitlines() if "on synthetic, protocol tiny" in t],
        "the tooltip",
        timeout=30,
    )
    first_lines = {run.data.tags[RUN_NOTE_TAG].splitlines()[0] for run in runs.values()}
    start = shown[0].rstrip(".…")  # the tooltip cuts the description after two rows
    assert any(start.startswith(line) or line.startswith(start) for line in first_lines), shown
    assert "&emsp;" not in shown[0] and "**" not in shown[0]
    away = driver.find_element(By.XPATH, "//*[normalize-space(text())='Runs']")
    ActionChains(driver).move_to_element(away).perform()  # the tooltip closes


def _scroll_to(driver, section: str, what: str) -> list[dict]:
    """Scroll the charts to ``section``; the four curves once drawn (a chart loads when in
    view), in their order."""
    from selenium.webdriver.common.by import By

    heading = driver.find_element(By.XPATH, f"//*[normalize-space(text())='{section}']")
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", heading)

    def drawn(d) -> list[dict]:
        plots = [p for p in _plots(d) if p["title"] in CURVES]
        return plots if len(plots) == len(CURVES) else []

    return _wait(driver, drawn, what)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_run_its_model_and_the_compare_page(served, width):
    """A run's page: the first lines of its description, deviations included, above the
    fold of *Show more*. Its model's page: the run's final metrics, its description. The
    compare page: the runs."""
    from selenium.webdriver.common.by import By

    runs = served["runs"]
    plain = runs["plain"]
    experiment_id, run_id = plain.info.experiment_id, plain.info.run_id
    note = plain.data.tags[RUN_NOTE_TAG].splitlines()
    driver = _browser(width)
    try:
        driver.get(f"{served['base']}/#/experiments/{experiment_id}/runs/{run_id}")
        _wait(driver, lambda d: note[2] in _text(d), "the run's description")
        _shot(driver, width, "run")
        _model_training(driver, "run")
        for line in (note[0], note[2]):  # shown, not under the fold's gradient
            element = driver.find_element(By.XPATH, f"//*[normalize-space(text())='{line}']")
            assert _unfolded(driver, element), line
        model_id = plain.data.tags["model_uri"].split("/")[-1]
        driver.get(f"{served['base']}/#/experiments/{experiment_id}/models/{model_id}")
        _wait(driver, lambda d: "train/loss" in _text(d) and note[0] in _text(d), "the model")
        _shot(driver, width, "model")
        loss = plain.data.metrics["train/loss"]
        assert float(_model_metric(driver, "train/loss")) == pytest.approx(loss, rel=1e-12)
        assert float(_model_metric(driver, "P at 1")) == plain.data.metrics["P at 1"]
        ids = json.dumps([r.info.run_id for r in runs.values()]).replace(" ", "")
        driver.get(f'{served["base"]}/#/compare-runs?runs={ids}&experiments=["{experiment_id}"]')
        _wait(driver, lambda d: "Comparing 3 Runs" in _text(d), "the compare page")
        _shot(driver, width, "compare")
    finally:
        driver.quit()


def _model_metric(driver, key: str) -> str:
    """The value the model page's metrics table shows for ``key`` (typed into its search
    box: the table draws the rows in view only)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    search = driver.find_element(By.CSS_SELECTOR, "input[placeholder='Search metrics']")
    search.send_keys(Keys.CONTROL, "a")  # what an earlier look-up typed goes
    search.send_keys(Keys.BACKSPACE, key)

    def row(d) -> list[str]:
        rows = d.execute_script(
            "return Array.from(document.querySelectorAll('[role=row]')).map(r => r.innerText)"
        )
        found = [r.split("\n") for r in rows if r.split("\n")[0] == key]
        return found[0] if found else []

    return _wait(driver, row, f"the model's {key}", timeout=30)[-1]


def _unfolded(driver, element) -> bool:
    """Whether ``element`` lies in the upper 60 % of the box that folds the description,
    or in no folded box: the UI fades the box's lower 60 % from clear to opaque, so there
    the text is at most a third faded."""
    return driver.execute_script(
        """
        const e = arguments[0];
        let box = e.parentElement;
        while (box && getComputedStyle(box).maxHeight === 'none') box = box.parentElement;
        if (!box) return true;
        const r = e.getBoundingClientRect(), b = box.getBoundingClientRect();
        return r.bottom <= b.top + 0.6 * b.height + 1;
        """,
        element,
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_a_runs_figures_and_the_table_inside_mlflow(served, width, tmp_path):
    """A run's retrieval examples and embedding map, drawn on its Artifacts tab; the table
    ``harness table`` logs, rendered on its run's Artifacts tab and linked from the first
    line of the experiment's description. Last in the module: the table's run is one more
    row of the runs table the tests above count."""
    from selenium.webdriver.common.by import By

    runs = served["runs"]
    experiment_id, run_id = runs["plain"].info.experiment_id, runs["plain"].info.run_id
    base = f"{served['base']}/#/experiments/{experiment_id}"
    # Before the browser opens: the page keeps the experiment it loaded first.
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        table = ["table", "--experiment", served["experiment"], "--format", "markdown"]
        assert main([*table, "--name", "ui-table"]) == 0
    driver = _browser(width)
    try:
        for figure in ("retrieval_examples", "embedding_map"):
            path = f"views/{figure}.png"
            driver.get("about:blank")  # a page load: the UI keeps a file chosen in the same page
            driver.get(f"{base}/runs/{run_id}/artifacts/{path}")
            _wait(
                driver,
                lambda d: f"{path}\n" in _text(d) and _drawn_images(d),  # noqa: B023 (waited here)
                f"the run's {path}",
            )
            _shot(driver, width, figure.replace("_", "-"))
        found = mlflow.MlflowClient().search_runs(
            [experiment_id], filter_string=f"tags.{TABLE_SET_TAG} = 'ui-table'"
        )
        link = f"/runs/{found[0].info.run_id}/artifacts/{TABLES_FOLDER}"
        driver.get(f"{base}/runs?{ML_VIEW_QUERY}")
        anchors = _wait(  # the description's link, not the run's name in the table
            driver,
            lambda d: d.find_elements(
                By.XPATH, f"//a[normalize-space(.)='ui-table' and contains(@href, '{link}')]"
            ),
            "the table's link in the experiment's description",
        )
        assert anchors[0].is_displayed() and anchors[0].get_attribute("href").endswith(link)
        _shot(driver, width, "table-link")
        driver.get(f"{served['base']}/#/experiments/{experiment_id}{link}/ui-table.md")
        _wait(driver, lambda d: "| " not in _text(d) and "Baseline" in _text(d), "the table")
        _shot(driver, width, "table")
        cells = driver.find_elements(By.XPATH, "//*[normalize-space(text())='Baseline']")
        assert cells and cells[0].is_displayed(), "the table's rows are rendered, not raw Markdown"
    finally:
        driver.quit()


def _drawn_images(driver) -> list[int]:
    """The widths of the page's images that the browser decoded (an artifact's preview)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('img'))"
        ".filter(i => i.complete && i.naturalWidth > 200).map(i => i.naturalWidth)"
    )
