"""``python -m harness explain-table --experiment NAME``: one table of the explanation
scores of every method (its own maps and the Grad-CAM baseline on its model), from the
``explain/*`` metrics that ``python -m harness explain`` logs to each run. Written as
Markdown and LaTeX; the newest explained run of each method is taken."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.base.errors import HarnessError
from harness.base.metric_keys import group_metrics

__all__ = ["COLUMNS", "ExplainRow", "explain_rows", "markdown_table", "latex_table"]

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


def explain_rows(experiments: list[str]) -> list[ExplainRow]:
    """Rows of the newest explained FINISHED run of each method in ``experiments``."""
    from harness.store.queries import newest_finished_runs

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
    head = "| method | maps | pairs (curves) | " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "---|" * (3 + len(COLUMNS))
    body = [
        f"| {r.method} | {r.source} | {r.pairs} ({r.curve_pairs}) | "
        + " | ".join(_cell(r.scores[k], "±") for k, _ in COLUMNS)
        + " |"
        for r in rows
    ]
    return "\n".join([head, rule, *body]) + "\n"


def latex_table(rows: list[ExplainRow], caption: str) -> str:
    def esc(text: str) -> str:
        return text.replace("_", r"\_")

    cols = "ll" + "r" * (1 + len(COLUMNS))
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        f"\\caption{{{esc(caption)}}}",
        f"\\begin{{tabular}}{{{cols}}}",
        r"\toprule",
        "Method & Maps & Pairs (curves) & " + " & ".join(esc(t) for _, t in COLUMNS) + r" \\",
        r"\midrule",
    ]
    lines += [
        f"{esc(r.method)} & {r.source} & {r.pairs} ({r.curve_pairs}) & "
        + " & ".join(_cell(r.scores[k], "$\\pm$") for k, _ in COLUMNS)
        + r" \\"
        for r in rows
    ]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"
