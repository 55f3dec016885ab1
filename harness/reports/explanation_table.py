"""``python -m harness explain-table --experiment NAME``: one table of the explanation
scores of every method (its own maps and the Grad-CAM baseline on its model), from the
``explain/*`` metrics that ``python -m harness explain`` logs to each run. Written as
Markdown and LaTeX. The newest explained run of each method and seed is taken; with several
seeds a row gives the mean over seeds and its 95% interval over seeds.

Under the methods, the reference rows of ``explain --sanity`` (the ceiling, the
uniform-on-object map that scores the within-object share's chance, the random map), read
from the first method's runs: the pairs, and so these maps, are the same for every run of
one test split and explain seed. Below the table, the cascade (:func:`cascade_markdown`):
each source's within-object share and rank correlation at each step of the cascading
randomisation."""

from __future__ import annotations

import math
import re
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
    "cascade_markdown",
    "latex_table",
    "SANITY_LEGEND",
]

#: (score, column title): lower is better for deletion, higher for the rest but chance.
COLUMNS = (
    ("within_object_share", "Within-object share"),
    ("within_object_chance", "Within-object chance"),
    ("within_object_pointing", "Within-object pointing"),
    ("trained_parts_randomised_within_object_share", "Trained parts randomised"),
    ("discriminative_part_share", "Diff. part share"),
    ("chance_part_share", "Chance share"),
    ("pointing_game", "Pointing game"),
    ("object_share", "Object share"),
    ("deletion_auc", "Deletion AUC (lower better)"),
    ("random_cells_deletion_auc", "Random-cell deletion"),
    ("insertion_auc", "Insertion AUC (higher better)"),
    ("random_cells_insertion_auc", "Random-cell insertion"),
)

#: The columns that are a property of the pairs, not of a map: the same on every row.
CHANCES = ("within_object_chance", "chance_part_share")

#: The reference rows of ``explain --sanity``: (sanity row, the row's label).
REFERENCES = (
    ("ground_truth", "ground truth (ceiling)"),
    ("uniform_on_object", "uniform on the object (chance)"),
    ("random", "random map (floor)"),
)

#: The verdicts a row's sanity mark reads: (verdict, the mark when it fails on a seed).
VERDICT_MARKS = (
    ("beats_chance", "<= chance"),
    ("changes_under_randomisation", "unchanged"),
    ("uses_training", "not from training"),
)


@dataclass
class ExplainRow:
    method: str
    source: str  # "own maps", "Grad-CAM baseline", or a reference map's label
    run_ids: list[str]  # one explained run per seed
    pairs: int  # per run
    curve_pairs: int
    #: score -> (mean, lo, hi): over pairs for one seed; over the seeds' means for several
    #: (a t-interval with n - 1 degrees of freedom: the spread between trained models).
    scores: dict[str, tuple[float, float, float]]
    seeds: list[str] = field(default_factory=list)
    #: The sanity verdicts of ``explain --sanity`` (:data:`VERDICT_MARKS`; None: not
    #: checked), each True only when it holds on every seed.
    verdicts: dict[str, bool | None] = field(default_factory=dict)
    #: Cascade step -> score -> (mean, lo, hi), the step's within-object share and rank
    #: correlation (``explain --sanity``), top step first.
    cascade: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)
    reference: bool = False


#: What the sanity column's marks mean, printed under the table.
SANITY_LEGEND = (
    "Sanity (explain --sanity), each a paired 95% t-interval over the pairs of each seed: "
    "ok = on every seed the within-object share beats its chance, the map changes when "
    "every weight is randomised (rank correlation below 0.5; Adebayo et al. 2018) and its "
    "within-object share drops once the parts the protocol trains are re-drawn; <= chance, "
    "unchanged, not from training = the check that fails on a seed; - = not checked. "
    "Trained parts randomised: the within-object share with the head and the trained "
    "backbone re-drawn."
)


def sanity_mark(row: ExplainRow) -> str:
    """The row's sanity verdicts in a word or two (:data:`SANITY_LEGEND`)."""
    if row.reference:
        return ""
    if all(row.verdicts.get(name) is None for name, _ in VERDICT_MARKS):
        return "-"
    marks = [mark for name, mark in VERDICT_MARKS if row.verdicts.get(name) is False]
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


def _scores(metrics: list[dict[str, float]], prefix: str, keys) -> dict[str, Any]:
    """Each of ``keys`` read as ``<prefix>_<key>`` (with ``_lo`` / ``_hi``) from every
    seed's metrics, over the seeds (:func:`_over_seeds`)."""
    return {
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
        for key in keys
    }


def _stage_order(stage: str) -> tuple[int, int]:
    """The cascade's order: the head first, then the backbone's points from the deepest."""
    if stage == "head":
        return (0, 0)
    stride = re.fullmatch(r"s(\d+)", stage)
    return (1, -int(stride.group(1))) if stride else (2, 0)


def _cascade(metrics: list[dict[str, float]], prefix: str) -> dict[str, dict[str, Any]]:
    """Step -> within-object share and rank correlation of source ``prefix`` over seeds."""
    pattern = re.compile(rf"sanity_randomised_(\w+?)_{prefix}_within_object_share")
    stages = {match.group(1) for key in metrics[0] if (match := pattern.fullmatch(key))}
    return {
        stage: _scores(
            metrics,
            f"sanity_randomised_{stage}_{prefix}",
            ("within_object_share", "rank_correlation"),
        )
        for stage in sorted(stages, key=_stage_order)
    }


def _reference_rows(method: str, runs: list, metrics: list[dict[str, float]]) -> list[ExplainRow]:
    """The reference maps' rows (:data:`REFERENCES`) from one method's explained runs."""
    rows = []
    for name, label in REFERENCES:
        if not all(f"sanity_{name}_within_object_share" in m for m in metrics):
            continue
        scores = _scores(metrics, f"sanity_{name}", [key for key, _ in COLUMNS])
        # The chance of each score is the pairs', the same for every map of them.
        scores.update(_scores(metrics, "baseline", CHANCES))
        rows.append(
            ExplainRow(
                "reference",
                label,
                [run.info.run_id for run in runs],
                int(metrics[0].get("pairs", 0)),
                0,
                scores,
                [run.data.tags.get("seed", "") for run in runs],
                reference=True,
            )
        )
    return rows


def _method_rows(method: str, seeds: list[str], runs: list, metrics: list) -> list[ExplainRow]:
    """The own-maps and Grad-CAM rows of one method over its seeds' runs."""
    rows = []
    for prefix, label in (("method", "own maps"), ("baseline", "Grad-CAM baseline")):
        if not all(f"{prefix}_deletion_auc" in m for m in metrics):
            continue
        rows.append(
            ExplainRow(
                method,
                label,
                [run.info.run_id for run in runs],
                int(metrics[0].get("pairs", 0)),
                int(metrics[0].get("curve_pairs", 0)),
                _scores(metrics, prefix, [key for key, _ in COLUMNS]),
                seeds,
                {name: _all_verdicts(metrics, f"{prefix}_{name}") for name, _ in VERDICT_MARKS},
                _cascade(metrics, prefix),
            )
        )
    return rows


def explain_rows(experiments: list[str]) -> list[ExplainRow]:
    """One row per method and map source: the newest explained FINISHED run of each seed in
    ``experiments``, aggregated over the seeds (:func:`_over_seeds`); then the reference
    rows, from the first method's runs that have them."""

    found = list(experiments)
    newest = _newest_explained_per_seed(found)
    if not newest:
        raise HarnessError(
            f"no run in {', '.join(found)} has explanation scores: run "
            f"'python -m harness explain --run RUN_ID' on its runs first"
        )
    rows: list[ExplainRow] = []
    references: list[ExplainRow] = []
    for method in sorted(newest):
        seeds = sorted(newest[method], key=lambda s: (len(s), s))
        runs = [newest[method][seed] for seed in seeds]
        metrics = [group_metrics(run.data.metrics, "explain") for run in runs]
        rows += _method_rows(method, seeds, runs, metrics)
        references = references or _reference_rows(method, runs, metrics)
    return rows + references


def _cell(value: tuple[float, float, float], plus_minus: str) -> str:
    mean, lo, hi = value
    if not math.isfinite(mean):
        return "-"
    half = (hi - lo) / 2
    if not (math.isfinite(lo) and math.isfinite(hi)) or round(half, 3) == 0:
        return f"{mean:.3f}"  # no interval, or the values agree to the digit
    return f"{mean:.3f} {plus_minus} {half:.3f}"


def _curve_pairs(row: ExplainRow) -> str:
    return f"{row.pairs} ({row.curve_pairs})" if not row.reference else str(row.pairs)


def markdown_table(rows: list[ExplainRow]) -> str:
    """The scores table, its legend, and the cascade (:func:`cascade_markdown`)."""
    head = (
        "| method | maps | seeds | pairs (curves) | "
        + " | ".join(title for _, title in COLUMNS)
        + " | Sanity |"
    )
    rule = "|" + "---|" * (5 + len(COLUMNS))
    body = [
        f"| {r.method} | {r.source} | {len(r.run_ids)} | {_curve_pairs(r)} | "
        + " | ".join(_cell(r.scores[k], "±") for k, _ in COLUMNS)
        + f" | {sanity_mark(r)} |"
        for r in rows
    ]
    cascade = cascade_markdown(rows)
    return (
        "\n".join([head, rule, *body])
        + "\n\n"
        + SANITY_LEGEND
        + "\n"
        + (f"\n{cascade}" if cascade else "")
    )


def cascade_markdown(rows: list[ExplainRow]) -> str:
    """Each source's cascading randomisation: per step (the head re-drawn, then each
    backbone point down to the first, each step keeping the ones before), the
    within-object share and the rank correlation with the trained model's map; "" when
    no row was explained with ``--sanity``."""
    with_cascade = [r for r in rows if r.cascade]
    if not with_cascade:
        return ""
    steps = sorted({s for r in with_cascade for s in r.cascade}, key=_stage_order)
    head = (
        "| method | maps | trained | "
        + " | ".join(f"{s} re-drawn: share / rank corr." for s in steps)
        + " |"
    )
    rule = "|" + "---|" * (3 + len(steps))
    body = []
    for r in with_cascade:
        cells = [
            f"{_cell(r.cascade[s]['within_object_share'], '±')} / "
            f"{_cell(r.cascade[s]['rank_correlation'], '±')}"
            if s in r.cascade
            else "-"
            for s in steps
        ]
        trained = _cell(r.scores["within_object_share"], "±")
        body.append(f"| {r.method} | {r.source} | {trained} | " + " | ".join(cells) + " |")
    title = (
        "Cascading randomisation (Adebayo et al. 2018, Sec. 3.1): the within-object share "
        "and the rank correlation with the trained model's map after each step, each step "
        "keeping the layers re-drawn before it."
    )
    return title + "\n\n" + "\n".join([head, rule, *body]) + "\n"


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
        f"{esc(r.method)} & {r.source} & {len(r.run_ids)} & {_curve_pairs(r)} & "
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
