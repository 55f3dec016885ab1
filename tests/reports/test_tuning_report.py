"""What a tuned grid's tables say of its search, from the final runs' tags alone: the
budget note, rows not tuned alike named and labelled, the appendix of chosen settings,
the best-so-far curve and its figure."""

from __future__ import annotations

import json

import pandas as pd

from harness.reports.tables.load import label_settings
from harness.reports.tuning import (
    best_so_far,
    settings_appendix,
    tuned_table_files,
    tuning_notes,
)

BUDGET = "4 TPE trials x 2 class-disjoint folds (sampler seed 0, 2 per round, pruner median)"


def _runs(trials=("4", "4", "4")) -> pd.DataFrame:
    methods = ["plain", "agrouping", "sam"]
    return pd.DataFrame(
        {
            "method": methods,
            "backbone": "resnet50",
            "loss": "margin",
            "dataset": "cub200",
            "options": [json.dumps({"pool": p}) for p in ("avg", "max", "avg")],
            "tuned": True,
            "init_from": False,
            "tune_budget": BUDGET,
            "tune_trials": list(trials),
            "tune_params": [
                json.dumps({"optimizer.lr_head": 1e-4 * (i + 1), "pool": "avg"}) for i in range(3)
            ],
            "tune_history": [json.dumps([0.1, None, 0.3 + i / 10, 0.2]) for i in range(3)],
            "tune_report": "separated",
        }
    )


def test_the_budget_is_stated_and_rows_tuned_with_another_budget_are_named_and_labelled():
    notes = tuning_notes(_runs())
    assert len(notes) == 1 and BUDGET in notes[0] and "separated report" in notes[0]
    odd = _runs(trials=("4", "4", "2"))
    notes = tuning_notes(odd)
    assert len(notes) == 2 and "NOT TUNED ALIKE" in notes[1] and "sam on cub200, margin" in notes[1]
    labels = label_settings(odd).set_index("method")["setting"]
    assert labels["plain"] == "tuned" and labels["sam"] == "tuned, other budget"  # options left out


def test_the_appendix_lists_each_rows_chosen_setting_in_markdown_and_latex():
    markdown = settings_appendix(_runs(), "markdown")
    assert markdown.count("| resnet50 | margin | cub200 |") == 3
    assert "optimizer.lr_head = 0.0003, pool = avg | 50.00 |" in markdown
    latex = settings_appendix(_runs(), "latex")
    assert r"\begin{tabular}" in latex and r"optimizer.lr\_head" in latex and "50.00" in latex


def test_best_so_far_keeps_the_best_over_pruned_trials(tmp_path):
    assert best_so_far([None, 0.2, None, 0.1, 0.4])[1:] == [0.2, 0.2, 0.2, 0.4]
    files = tuned_table_files(_runs(), tmp_path / "grid", "latex")
    assert sorted(p.name for p in files) == [
        "grid.search.pdf",
        "grid.search.png",
        "grid.settings.tex",
    ]
    assert all(len(data) > 500 for data in files.values())
    assert files == tuned_table_files(_runs(), tmp_path / "grid", "latex")  # the same bytes
    assert tuned_table_files(_runs().assign(tune_budget=""), tmp_path / "grid", "latex") == {}
