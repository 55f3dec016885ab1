"""``python -m harness explain-table --experiment NAME``: one table of the explanation
scores of every method (its own maps and the Grad-CAM baseline on its model), from the
``explain/*`` metrics that ``python -m harness explain`` logs to each run. Written as
Markdown and LaTeX. The newest explained run of each method and seed is taken; with several
seeds a row gives the mean over seeds and its 95% interval over seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from harness.base.errors import HarnessError
from harness.base.metric_keys import group_metrics
from harness.components.explanation.scores import mean_interval
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
    ("random_cells_deletion_auc", "Random-cell deletion"),
    ("insertion_auc", "Insertion AUC (higher better)"),
    ("random_insertion_auc", "Random insertion"),
    ("random_cells_insertion_auc", "Random-cell insertion"),
)


@dataclass
class ExplainRow:
    method: str
    source: str  # "own maps" or "Grad-CAM baseline"
    run_ids: list[str]  # one explained run per seed
    pairs: int  # per run
    curve_pairs: int
    #: score -> (mean, lo, hi): over pairs for one seed; over the seeds' means for several
    #: (a t-interval with n - 1 degrees of freedom: the spread between trained models).
    scores: dict[str, tuple[float, float, float]]
    seeds: list[str] = field(default_factory=list)
    #: The sanity verdicts of ``explain --sanity`` (None: not checked), on every seed.
    beats_random: bool | None = None
    changes_under_randomisation: bool | None = None


#: What the sanity column's marks mean, printed under the table.
SANITY_LEGEND = (
    "Sanity (explain --sanity): ok = the maps beat the random map beyond both 95% intervals "
    "and change when the model's weights are randomised (Adebayo et al. 2018), on every "
    "seed; <= random = they do not beat the random map; unchanged = they survive the "
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


def _all_verdicts(runs_metrics: list[dict[str, float]], key: str) -> bool | None:
    """True when every seed's run says so, False when one does not, None when none was checked."""
    found = [bool(m[key]) for m in runs_metrics if key in m]
    return None if not found else all(found)


def _newest_explained_per_seed(experiments: list[str]) -> dict[str, dict[str, Any]]:
    """method -> seed -> the newest FINISHED run with explanation scores."""
    newest: dict[str, dict[str, Any]] = {}
    for run in newest_finished_runs(experiments):
        metrics = group_metrics(run.data.metrics, "explain")
        method, seed = run.data.tags.get("method", ""), run.data.tags.get("seed", "")
        if "baseline_deletion_auc" in metrics and method:
            newest.setdefault(method, {}).setdefault(seed, run)
    return newest


def _over_seeds(per_seed: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """One seed: its interval over pairs. Several: the mean of the seeds' means and its 95%
    t-interval over seeds."""
    if len(per_seed) == 1:
        return per_seed[0]
    return mean_interval([mean for mean, _, _ in per_seed], bounds=(-math.inf, math.inf))


def explain_rows(experiments: list[str]) -> list[ExplainRow]:
    """One row per method and map source: the newest explained FINISHED run of each seed in
    ``experiments``, aggregated over the seeds (:func:`_over_seeds`)."""

    found = list(experiments)
    newest = _newest_explained_per_seed(found)
    if not newest:
        raise HarnessError(
            f"no run in {', '.join(found)} has explanation scores: run "
            f"'python -m harness explain --run RUN_ID' on its runs first"
        )
    rows = []
    for method in sorted(newest):
        seeds = sorted(newest[method], key=lambda s: (len(s), s))
        runs = [newest[method][seed] for seed in seeds]
        metrics = [group_metrics(run.data.metrics, "explain") for run in runs]
        for prefix, label in (("method", "own maps"), ("baseline", "Grad-CAM baseline")):
            if not all(f"{prefix}_deletion_auc" in m for m in metrics):
                continue
            scores = {
                key: _over_seeds(
                    [
                        (
                            m.get(f"{prefix}_{key}", math.nan),
                            m.get(f"{prefix}_{key}_lo", math.nan),
                            m.get(f"{prefix}_{key}_hi", math.nan),
                        )
                        for m in metrics
                    ]
                )
                for key, _ in COLUMNS
            }
            rows.append(
                ExplainRow(
                    method,
                    label,
                    [run.info.run_id for run in runs],
                    int(metrics[0].get("pairs", 0)),
                    int(metrics[0].get("curve_pairs", 0)),
                    scores,
                    seeds,
                    _all_verdicts(metrics, f"{prefix}_beats_random"),
                    _all_verdicts(metrics, f"{prefix}_changes_under_randomisation"),
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
        "| method | maps | seeds | pairs (curves) | "
        + " | ".join(title for _, title in COLUMNS)
        + " | Sanity |"
    )
    rule = "|" + "---|" * (5 + len(COLUMNS))
    body = [
        f"| {r.method} | {r.source} | {len(r.run_ids)} | {r.pairs} ({r.curve_pairs}) | "
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

    cols = "ll" + "r" * (2 + len(COLUMNS)) + "l"
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        f"\\caption{{{esc(caption)}}}",
        f"\\begin{{tabular}}{{{cols}}}",
        r"\toprule",
        "Method & Maps & Seeds & Pairs (curves) & "
        + " & ".join(esc(t) for _, t in COLUMNS)
        + r" & Sanity \\",
        r"\midrule",
    ]
    lines += [
        f"{esc(r.method)} & {r.source} & {len(r.run_ids)} & {r.pairs} ({r.curve_pairs}) & "
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
