"""``python -m harness explain-table --experiment NAME``: one table of the explanation
scores of every method (its own maps and the Grad-CAM baseline on its model), from the
``explain/*`` metrics that ``python -m harness explain`` logs to each run. Written as
Markdown and LaTeX; the newest explained run of each method is taken."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.base.errors import HarnessError
from harness.base.metric_keys import group_metrics
from harness.store.queries import newest_finished_runs

__all__ = [
    "COLUMNS",
    "ExplainRow",
    "explain_rows",
    "sanity_mark",
    "markdown_table",
    "latex_table",
    "SANITY_LEGEND",
]

#: (score, column title): lower is better for deletion, higher for the rest but chance.
COLUMNS = (
    ("pointing_game", "Pointing game"),
    ("discriminative_part_share", "Diff. part share"),
    ("chance_part_share", "Chance share"),
    ("object_share", "Object share"),
    ("deletion_auc", "Deletion AUC (lower better)"),
    ("random_deletion_auc", "Random deletion"),
    ("insertion_auc", "Insertion AUC (higher better)"),
    ("random_insertion_auc", "Random insertion"),
)


@dataclass
class ExplainRow:
    method: str
    source: str  # "own maps" or "Grad-CAM baseline"
    run_id: str
    pairs: int
    curve_pairs: int
    scores: dict[str, tuple[float, float, float]]  # score -> (mean, lo, hi)
    #: The sanity verdicts of ``explain --sanity`` (None: not checked).
    beats_random: bool | None = None
    changes_under_randomisation: bool | None = None


#: What the sanity column's marks mean, printed under the table.
SANITY_LEGEND = (
    "Sanity (explain --sanity): ok = the maps beat the random map beyond both 95% intervals "
    "and change when the model's weights are randomised (Adebayo et al. 2018); "
    "<= random = they do not beat the random map; unchanged = they survive the "
    "randomisation of every layer; - = not checked."
)


def sanity_mark(row: ExplainRow) -> str:
    """The row's sanity verdicts in a word or two (:data:`SANITY_LEGEND`)."""
    if row.beats_random is None and row.changes_under_randomisation is None:
        return "-"
    marks = [
        mark
        for failed, mark in (
            (row.beats_random is False, "<= random"),
            (row.changes_under_randomisation is False, "unchanged"),
        )
        if failed
    ]
    return ", ".join(marks) or "ok"


def _verdict(metrics: dict[str, float], key: str) -> bool | None:
    return None if key not in metrics else bool(metrics[key])


def explain_rows(experiments: list[str]) -> list[ExplainRow]:
    """Rows of the newest explained FINISHED run of each method in ``experiments``."""

    found = list(experiments)
    runs = newest_finished_runs(found)
    newest = {}
    for run in runs:
        metrics = group_metrics(run.data.metrics, "explain")
        method = run.data.tags.get("method", "")
        if "baseline_deletion_auc" in metrics and method and method not in newest:
            newest[method] = run
    if not newest:
        raise HarnessError(
            f"no run in {', '.join(found)} has explanation scores: run "
            f"'python -m harness explain --run RUN_ID' on its runs first"
        )
    rows = []
    for method in sorted(newest):
        run = newest[method]
        m = group_metrics(run.data.metrics, "explain")
        for prefix, label in (("method", "own maps"), ("baseline", "Grad-CAM baseline")):
            if f"{prefix}_deletion_auc" not in m:
                continue
            scores = {
                key: (
                    m.get(f"{prefix}_{key}", math.nan),
                    m.get(f"{prefix}_{key}_lo", math.nan),
                    m.get(f"{prefix}_{key}_hi", math.nan),
                )
                for key, _ in COLUMNS
            }
            rows.append(
                ExplainRow(
                    method,
                    label,
                    run.info.run_id,
                    int(m.get("pairs", 0)),
                    int(m.get("curve_pairs", 0)),
                    scores,
                    _verdict(m, f"{prefix}_beats_random"),
                    _verdict(m, f"{prefix}_changes_under_randomisation"),
                )
            )
    return rows


def _cell(value: tuple[float, float, float], plus_minus: str) -> str:
    mean, lo, hi = value
    if not math.isfinite(mean):
        return "-"
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi == lo:
        return f"{mean:.3f}"
    return f"{mean:.3f} {plus_minus} {(hi - lo) / 2:.3f}"


def markdown_table(rows: list[ExplainRow]) -> str:
    head = (
        "| method | maps | pairs (curves) | "
        + " | ".join(title for _, title in COLUMNS)
        + " | Sanity |"
    )
    rule = "|" + "---|" * (4 + len(COLUMNS))
    body = [
        f"| {r.method} | {r.source} | {r.pairs} ({r.curve_pairs}) | "
        + " | ".join(_cell(r.scores[k], "±") for k, _ in COLUMNS)
        + f" | {sanity_mark(r)} |"
        for r in rows
    ]
    return "\n".join([head, rule, *body]) + "\n\n" + SANITY_LEGEND + "\n"


def _latex_mark(text: str) -> str:
    return text.replace("<=", r"$\le$")


def latex_table(rows: list[ExplainRow], caption: str) -> str:
    def esc(text: str) -> str:
        return text.replace("_", r"\_")

    cols = "ll" + "r" * (1 + len(COLUMNS)) + "l"
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        f"\\caption{{{esc(caption)}}}",
        f"\\begin{{tabular}}{{{cols}}}",
        r"\toprule",
        "Method & Maps & Pairs (curves) & "
        + " & ".join(esc(t) for _, t in COLUMNS)
        + r" & Sanity \\",
        r"\midrule",
    ]
    lines += [
        f"{esc(r.method)} & {r.source} & {r.pairs} ({r.curve_pairs}) & "
        + " & ".join(_cell(r.scores[k], "$\\pm$") for k, _ in COLUMNS)
        + " & "
        + _latex_mark(sanity_mark(r))
        + r" \\"
        for r in rows
    ]
    lines += [r"\bottomrule", r"\end{tabular}"]
    legend = _latex_mark(esc(SANITY_LEGEND)).replace("%", r"\%")
    lines += [r"\par\footnotesize " + legend, r"\end{table}"]
    return "\n".join(lines) + "\n"
