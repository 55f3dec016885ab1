"""The notes under a table, from its runs and published values: how the numbers were
selected, metric variants, evaluation code, rows told apart by their setting, published
values left out or flagged, and where the runs depart from the paper."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from harness.components.data.base import GIVEN_VALIDATION
from harness.config.deviations import from_tag, grouped_notes
from harness.methods import METHODS
from harness.reports.tables.effects import effect_notes
from harness.reports.tables.labels import METRIC_LABELS, label
from harness.reports.tables.layout import distinct_in_order

__all__ = [
    "SELECTION_TEXT",
    "SETTINGS_NOTE",
    "selection_notes",
    "code_notes",
    "variant_notes",
    "setting_notes",
    "published_notes",
    "run_deviations",
    "paper_deviation_notes",
]

SELECTION_TEXT = {
    "validation": "the epoch with the best validation {metric}, on a class-disjoint validation "
    "split of {fraction} of the training classes (trained on the rest)",
    "test-paper": "the epoch with the best TEST-set score (the papers' released code; optimistic)",
    "last": "the last epoch",
}
#: A tuned grid's fold models (``tune_folds``: "k class-disjoint folds of the training
#: classes, seed s"): each trained on the other folds, its epoch chosen on its own.
FOLD_SELECTION_TEXT = (
    "each of the {k} fold models trained on {rest}/{k} of the training classes and its epoch "
    "chosen by the best validation {metric} on the held-out fold ({folds})"
)
#: Validation on the dataset's own split (a CSV's ``validation`` rows), not a carve.
GIVEN_SELECTION_TEXT = (
    "the epoch with the best validation {metric}, on the dataset's own class-disjoint "
    "validation split"
)
SETTINGS_NOTE = (
    "[...]: runs of one method that differ in method options, were tuned (harness tune) or "
    "trained from another run's weights (--init-from) are separate rows, labelled by what differs."
)


def selection_notes(runs: pd.DataFrame, published: Path | None) -> list[str]:
    """How the reproduced numbers were selected (from the runs' ``selection`` tags) against
    how the published ones were: the ``published_selection`` of the paper whose plugin is
    registered under the published CSV's name (:class:`harness.methods.PaperInfo`)."""
    notes = []
    if not runs.empty:
        parts = [
            _selection_text(runs[runs["selection"] == mode], mode)
            for mode in distinct_in_order(runs["selection"])
        ]
        notes.append("Model selection of the reproduced numbers: " + "; ".join(parts) + ".")
    if published is not None:
        # Imported when called: the plugins pull in torch, which reading a table never needs otherwise.

        stem = Path(published).stem
        paper = METHODS.get(stem).cls.paper if stem in METHODS else None
        if paper is not None and paper.published_selection:
            notes.append(f"Published numbers: {paper.published_selection}.")
    return notes


def _selection_text(runs: pd.DataFrame, mode: str) -> str:
    """How the runs of one selection mode chose their epoch, with their validation share
    and metric when all runs agree on them."""
    fractions = sorted({f for f in runs.get("validation_classes", []) if f})
    chosen = sorted({m for m in runs.get("selection_metric", []) if m})
    metric = label(METRIC_LABELS, chosen[0]) if len(chosen) == 1 else "score"
    folds = sorted({f for f in runs.get("tune_folds", pd.Series(dtype=object)).fillna("") if f})
    if mode == "validation" and len(folds) == 1 and folds[0][:1].isdigit():
        k = int(folds[0].split()[0])
        return FOLD_SELECTION_TEXT.format(metric=metric, k=k, rest=k - 1, folds=folds[0])
    if mode == "validation" and fractions == [GIVEN_VALIDATION]:
        return GIVEN_SELECTION_TEXT.format(metric=metric)
    single = len(fractions) == 1 and fractions != [GIVEN_VALIDATION]
    fraction = f"{float(fractions[0]):.0%}" if single else "a fraction"
    return SELECTION_TEXT.get(mode, mode).format(metric=metric, fraction=fraction)


def code_notes(runs: pd.DataFrame) -> list[str]:
    """The note of the § mark: runs scored by different evaluation code, or lacking the tag."""
    codes = (
        runs["evaluation_code"] if "evaluation_code" in runs else pd.Series("", index=runs.index)
    )
    distinct = sorted(set(codes) - {""})
    missing = int((codes == "").sum())
    if len(distinct) <= 1 and not missing:
        return []
    what = []
    if len(distinct) > 1:
        what.append(f"its runs were scored by different evaluation code ({', '.join(distinct)})")
    if missing:
        what.append(f"{missing} run(s) lack the evaluation_code tag (older harness)")
    return [f"§ block where {' and '.join(what)}: its rows may differ by more than the method."]


def variant_notes(metrics: Sequence[str], metric_map: dict[str, str]) -> list[str]:
    """What the query-in-R variants of RP and MAP@R are, and which published metrics sit
    beside them (``metric_map``: ``{published metric: reproduced metric}``)."""
    if not any(m.endswith("_query_in_r") for m in [*metrics, *metric_map.values()]):
        return []
    text = (
        "RP (query in R), MAP@R (query in R): DIML's released evaluation (wl-zhao/DIML evaluation/metrics.py), "
        "R = the class size with the query itself counted, from the same ranking as RP and MAP@R "
        "(a perfect ranking scores (n-1)/n)."
    )
    if metric_map:
        text += (
            " The published "
            + ", ".join(f"{label(METRIC_LABELS, p)}" for p in metric_map)
            + " sit beside these variants, as the paper measured them."
        )
    return [text]


def setting_notes(cells: pd.DataFrame) -> list[str]:
    """The note on rows labelled by their setting, when a row has one."""
    return [SETTINGS_NOTE] if (cells["setting"] != "").any() else []


def published_notes(excluded: Sequence[str], flagged: Sequence[str]) -> list[str]:
    """Footnotes for the published values: those left out of the comparison
    (``column_mislabelled``) and each note a published row is flagged with."""
    lines = [f"Published values not compared: {'; '.join(excluded)}."] if excluded else []
    return lines + [f"Published values marked {note}" for note in flagged]


def run_deviations(runs: pd.DataFrame) -> list[str]:
    """The protocol deviations the runs record (``deviations`` tags), and test-set model
    selection when a run used it: what the † mark's footnote lists."""
    recorded = {
        d
        for d, s in zip(runs["deviations"], runs["test_set_selection"], strict=True)
        if d != "none"
    }
    return sorted(
        recorded | ({"test-set model selection"} if runs["test_set_selection"].any() else set())
    )


def paper_deviation_notes(runs: pd.DataFrame) -> list[str]:
    """The deviations from a paper or its code that any run of the table records
    (``deviation.<name>`` tags: the protocols' ``[deviations]`` tables, a smoke version's
    settings), one note per reason; then the effects measured of the grids the runs'
    experiments belong to (:mod:`harness.reports.tables.effects`)."""
    found = {
        name: from_tag(text)
        for tags in runs.get("paper_deviations", [])
        for name, text in tags.items()
    }
    experiments = runs["experiment"] if "experiment" in runs else []
    return grouped_notes(found) + (effect_notes(set(experiments)) if found else [])
