"""The documentation builds without a warning, and its plugin example works as written."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.methods import METHODS

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_PAGE = REPO / "docs" / "writing-a-plugin.md"
#: The page promises a worked example of at most this many lines.
MAX_EXAMPLE_LINES = 50


def _plugin_example() -> tuple[str, str]:
    """(name, code) of the block that follows ``<!-- plugin-example: NAME -->``."""
    found = re.search(
        r"<!-- plugin-example: (\w+) -->\n```python\n(.*?)\n```", EXAMPLE_PAGE.read_text(), re.S
    )
    assert found, f"{EXAMPLE_PAGE.name} has no plugin-example block"
    return found.group(1), found.group(2) + "\n"


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the [test] extra")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NO_MKDOCS_2_WARNING": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "methods-base" / "index.html").read_text().count(
        "register_variant"
    ) > 0


def test_the_plugin_example_is_short():
    name, code = _plugin_example()
    assert len(code.splitlines()) <= MAX_EXAMPLE_LINES, (
        f"the {name} example has {len(code.splitlines())} lines"
    )


def test_the_plugin_example_registers_and_runs_as_written(tmp_path, data_root, tracking_dir):
    """The block saved as ``harness/methods/<name>.py`` (in a copy of the package, first on the
    path) is found with no other edit and trains and evaluates end to end."""
    name, code = _plugin_example()
    if name in METHODS.list():  # a package installed beside the harness registers the name
        code = code.replace(f'register_method("{name}"', f'register_method("{name}_example"')
        name = f"{name}_example"
    copy = tmp_path / "pkg"
    shutil.copytree(
        REPO / "harness", copy / "harness", ignore=shutil.ignore_patterns("__pycache__")
    )
    for data in ("protocols", "results"):  # found beside the package, as in the checkout
        (copy / data).symlink_to(REPO / data)
    assert not (copy / "harness" / "methods" / f"{name}.py").exists()
    (copy / "harness" / "methods" / f"{name}.py").write_text(code)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(copy), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "--methods",
            name,
            "--protocol",
            str(REPO / "tests" / "protocols" / "tiny.toml"),
            "--json",
            "out.json",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = json.loads((work / "out.json").read_text())
    records = records if isinstance(records, list) else [records]
    (record,) = [r for r in records if r["method"] == name]
    metrics = record["metrics"]
    for metric in ("precision_at_1", "mean_average_precision_at_r", "r_precision"):
        assert math.isfinite(metrics[metric]), (metric, metrics[metric])


LIBRARY_PAGE = REPO / "docs" / "library.md"


def test_the_library_example_trains_and_resumes_as_written(data_root, capsys):
    """docs/library.md's example, run as written (as open-metric-learning runs its README's
    code): a plugin trained one epoch with an in-memory recorder, resumed from its
    checkpoint for the second epoch, then tested."""
    found = re.search(
        r"<!-- library-example -->\n```python\n(.*?)\n```", LIBRARY_PAGE.read_text(), re.S
    )
    assert found, f"{LIBRARY_PAGE.name} has no library-example block"
    names: dict = {}
    exec(compile(found.group(1), str(LIBRARY_PAGE), "exec"), names)
    assert [r["epoch"] for r in names["recorder"].epochs] == [2]
    assert [c["epoch"] for c in names["checkpointer"].saved] == [1, 2]
    assert names["recorder"].selected_epoch == names["selected"] in (1, 2)
    assert math.isfinite(names["scores"]["precision_at_1"])
    assert "trained epoch 2" in capsys.readouterr().out
