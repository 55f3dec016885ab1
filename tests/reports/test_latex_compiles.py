"""Every grid's LaTeX table (what ``nox -s tables`` writes, from runs planted for every cell
of the grid) compiles with pdflatex in a minimal one-column and two-column article, with
no error and no overfull box wider than 1pt. Slow; skipped where pdflatex is not installed
(Debian: ``apt-get install texlive-latex-recommended``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.config.catalog import list_grids
from harness.config.grids import load_grid
from harness.reports.tables import LATEX_PACKAGES, TableRequest, make_table

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("pdflatex") is None,
        reason="pdflatex is not installed (Debian: apt-get install texlive-latex-recommended)",
    ),
]

#: Every metric a grid's table may show (the published tables' and the grids' columns).
METRICS = [
    "precision_at_1",
    "recall_at_1",
    "recall_at_2",
    "recall_at_4",
    "recall_at_8",
    "recall_at_10",
    "recall_at_16",
    "recall_at_32",
    "recall_at_100",
    "nmi",
    "f1",
    "map_at_c",
    "r_precision",
    "mean_average_precision_at_r",
    "r_precision_query_in_r",
    "mean_average_precision_at_r_query_in_r",
]
OVERFULL = re.compile(r"Overfull \\hbox \((\d+(?:\.\d+)?)pt too wide\)")


def planted_runs(grid) -> pd.DataFrame:
    """One FINISHED run per cell of ``grid``, in :func:`harness.reports.tables.load_runs`'s
    columns, with scores spread so that intervals and differences take their widest form; the
    first block's runs carry a deviation and differ in evaluation code (its marks)."""
    rng = np.random.default_rng(0)
    rows = []
    first_block = (grid.cells[0].backbone, grid.cells[0].loss)
    for cell in grid.cells:
        odd = (cell.backbone, cell.loss) == first_block  # every mark and footnote shows up
        rows.append(
            {
                "run_id": uuid.uuid4().hex,
                "experiment": grid.experiment,
                "backbone": cell.backbone,
                "loss": cell.loss,
                "method": cell.method,
                "setting": "",
                "dataset": cell.dataset,
                "seed": str(cell.seed),
                "fingerprint": f"{cell.backbone}-{cell.loss}-{cell.dataset}",
                "deviations": "schedule.epochs: 150 -> 1 (× 2, λ ≤ 0.5)" if odd else "none",
                "test_set_selection": False,
                "method_revision": 1,
                "selection": "validation",
                "validation_classes": "0.2",
                "selection_metric": "mean_average_precision_at_r",
                "evaluation_code": f"code-{cell.seed}" if odd else "code",
                "options": json.dumps({}),
                "tuned": False,
                "init_from": False,
                "paper_deviations": {},
                **{f"test_{m}": rng.uniform(0.05, 0.95) for m in METRICS},
            }
        )
    return pd.DataFrame(rows)


def _compile(table: str, folder: Path, options: str) -> str:
    name = f"article-{options or 'onecolumn'}"
    preamble = "\n".join(f"\\usepackage{{{p}}}" for p in LATEX_PACKAGES)
    (folder / "table.tex").write_text(table, encoding="utf-8")
    (folder / f"{name}.tex").write_text(
        f"\\documentclass[{options}]{{article}}\n{preamble}\n\\begin{{document}}\n"
        "\\input{table.tex}\n\\end{document}\n",
        encoding="utf-8",
    )
    done = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", f"{name}.tex"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = (folder / f"{name}.log").read_text(encoding="utf-8", errors="replace")
    assert done.returncode == 0, log[-3000:]
    return log


@pytest.mark.parametrize("grid_name", list_grids())
def test_every_grid_table_compiles_and_fits_the_text_block(grid_name, tmp_path):
    grid = load_grid(grid_name)
    request = TableRequest(
        experiments=(grid.experiment,),
        fmt="latex",
        published=grid.published_file or None,
        tables=tuple(grid.published_tables),
        metrics=tuple(grid.metrics) or None,
        caption=grid.description,
        published_rows=dict(grid.published_rows) or None,
        baseline=grid.baseline,
        published_metrics=grid.published_metrics or None,
        per_query=lambda run_id: None,
    )  # no per-query results: the ‡ marks and note
    table = make_table(request, runs=planted_runs(grid))
    assert table.problems and "$^{\\ddagger}$" in table.text and "$^\\dagger$" in table.text
    assert "\\scriptsize" not in table.text and "\\tiny" not in table.text
    assert not table.tests.empty  # the paired-tests tables are compiled too
    for options in ("", "twocolumn"):
        log = _compile(table.text, tmp_path, options)
        too_wide = [float(x) for x in OVERFULL.findall(log)]
        assert not [w for w in too_wide if w > 1.0], (
            f"{grid_name} ({options or 'onecolumn'}): overfull by {too_wide}"
        )
        assert "! " not in log
