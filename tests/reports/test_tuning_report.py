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

BUDGET = (
    "4 trials (Optuna's TPE, random until 10 are settled) x 2 class-disjoint folds "
    "(sampler seed 0, 2 per round, pruner median)"
)


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


def test_a_grid_of_one_fold_is_one_model_per_seed_in_the_notes():
    """With ``folds = 1`` the final runs carry no report tag, which the store reads as "" ."""
    runs = _runs().assign(tune_report="")
    assert "each cell is the mean over seeds of one model per seed" in tuning_notes(runs)[0]


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


def _searched(runs: pd.DataFrame) -> pd.DataFrame:
    searches = [
        {
            "dimensions": 3,
            "completed": 40,
            "pruned": 10,
            "random": 12,
            "late_gain": 0.1,
            "fold_noise": 0.4,
            "converged": True,
            "search_seed": 5,
        },
        {
            "dimensions": 3,
            "completed": 46,
            "pruned": 4,
            "random": 12,
            "late_gain": 1.3,
            "fold_noise": 0.4,
            "converged": False,
            "search_seed": 5,
        },
        {
            "dimensions": 3,
            "completed": 50,
            "pruned": 0,
            "random": 12,
            "late_gain": 0.0,
            "fold_noise": float("nan"),
            "converged": None,
            "search_seed": 5,
        },
    ]
    return runs.assign(tune_search=[json.dumps(s) for s in searches], seed=["0", "1", "2"])


def test_each_row_states_its_dimensions_trials_and_budget_check():
    (note,) = [n for n in tuning_notes(_searched(_runs())) if n.startswith("Search per row")]
    assert "TPE after 12 random trials of 50" in note
    assert (
        "plain (margin, cub200): 3 dimensions, 40 / 10 / 12, late gain +0.10 vs fold noise 0.40: converged"
        in note
    )
    assert (
        "agrouping (margin, cub200): 3 dimensions, 46 / 4 / 12, late gain +1.30 vs fold noise 0.40: STILL IMPROVING"
        in note
    )
    assert "sam (margin, cub200): 3 dimensions, 50 / 0 / 12, budget check n/a (one fold)" in note
    assert "The search trained with seed 5, the reported runs with seeds 0, 1, 2" in note


def test_a_tuned_tables_selection_note_describes_the_fold_it_selected_on():
    from harness.reports.tables.notes import selection_notes

    runs = _runs().assign(
        selection="validation",
        validation_classes="0.2",
        selection_metric="mean_average_precision_at_r",
        tune_folds="4 class-disjoint folds of the training classes, seed 0",
    )
    (note,) = selection_notes(runs, None)
    assert (
        "each of the 4 fold models trained on 3/4 of the training classes and its epoch chosen by "
        "the best validation MAP@R on the held-out fold (4 class-disjoint folds" in note
    )
    assert "20% of the training classes" not in note


def test_a_test_time_methods_row_says_its_options_are_untuned_and_has_no_concatenated_row():
    from harness.reports.tables.load import select_report

    study = "tune:fair:resnet50/margin/plain/cub200:abc"
    rows = []
    for method in ("plain", "diml"):
        for report in ("separated", "concatenated"):
            rows.append({"method": method, "tune_study": study, "tune_report": report})
    runs = _runs().iloc[[0, 0, 0, 0]].reset_index(drop=True).assign(**pd.DataFrame(rows))
    labels = label_settings(runs).set_index(["method", "tune_report"])["setting"]
    assert labels[("plain", "separated")] == "tuned"
    assert labels[("diml", "separated")] == "own options untuned, on tuned plain"
    concatenated = select_report(runs, "concatenated")
    assert list(concatenated["method"]) == ["plain"]
    assert sorted(select_report(runs, "separated")["method"]) == ["diml", "plain"]


def test_rows_with_trials_per_dimension_are_tuned_alike_though_their_trials_differ():
    per_dimension = "3 trials per searched dimension (Optuna's TPE) x 2 class-disjoint folds"
    runs = _runs(trials=("9", "12", "36")).assign(tune_budget=per_dimension)
    assert len(tuning_notes(runs)) == 1  # no NOT TUNED ALIKE note
    assert set(label_settings(runs)["setting"]) == {"tuned"}
    other = runs.assign(tune_budget=[per_dimension, per_dimension, "4 trials x 2 folds"])
    assert "NOT TUNED ALIKE" in tuning_notes(other)[-1]
