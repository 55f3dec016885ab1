"""``harness.reports`` stays in small pieces (no module over 600 lines, no function over 60
from its ``def`` line to its last line), and the table formats are renderer objects that
share one interface and draw the same marks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness.base.errors import HarnessError
from harness.reports.tables import (
    RENDERERS,
    Cell,
    LatexRenderer,
    MarkdownRenderer,
    TableRenderer,
    TableRequest,
)

REPORTS = Path(__file__).resolve().parents[2] / "harness" / "reports"
MODULE_LINES, FUNCTION_LINES = 600, 60


@pytest.mark.parametrize(
    "path", sorted(REPORTS.rglob("*.py")), ids=lambda p: str(p.relative_to(REPORTS))
)
def test_report_modules_and_their_functions_are_short(path):
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MODULE_LINES
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    ]
    assert not long


def test_each_format_draws_every_mark_a_cell_names():
    cell = Cell(
        mean=61.0,
        half_width=1.5,
        n=3,
        published=60.0,
        bold=True,
        marks=("tied", "t_up", "boot_down", "incomplete", "flagged", "code"),
    )
    assert MarkdownRenderer().cell_text(cell) == "**61.00** ± 1.50≈↑⇓‡†§ (n=3) / 60.00 (+1.00)"
    latex = LatexRenderer()
    assert latex.reproduced(cell) == (
        "\\textbf{61.00}$\\pm$1.50$^{\\approx}$$^{\\uparrow}$$^{\\Downarrow}$"
        "$^{\\ddagger}$$^\\dagger$$^\\S$"
    )
    assert latex.published(cell) == "60.00 ($+$1.00)"
    assert all(issubclass(renderer, TableRenderer) for renderer in RENDERERS.values())
    assert all(
        set(renderer.marks) == set(MarkdownRenderer.marks) for renderer in RENDERERS.values()
    )


def test_a_table_request_refuses_an_unknown_format():
    with pytest.raises(HarnessError, match="unknown table format 'html'.* valid: latex, markdown"):
        TableRequest(experiments=("e",), fmt="html")
