"""What a tuned grid's tables say of the search (:mod:`harness.engine.tuning.sweep`), read
from the final runs' tags alone: the budget note under the table (and a warning with the
rows marked when the rows' budgets differ), the appendix of each row's chosen
hyperparameters (Markdown and LaTeX), and the best validation value so far against the
trial number, one line per method of a block (MLRC, Musgrave et al. 2020, plots the same
to show whether a budget was enough).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

__all__ = [
    "tuned_runs",
    "tuning_notes",
    "fold_report",
    "unequal_budget_rows",
    "budget_keys",
    "settings_appendix",
    "best_so_far",
    "search_notes",
    "search_figure_files",
    "search_figure_paths",
    "tuned_table_files",
    "tuned_table_paths",
]

BLOCK = ["backbone", "loss", "dataset"]


def tuned_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that are final results of a tuned grid (a ``tune_budget`` tag)."""
    if "tune_budget" not in runs:
        return runs.iloc[0:0]
    return runs[runs["tune_budget"].fillna("") != ""]


def unequal_budget_rows(runs: pd.DataFrame) -> list[str]:
    """Methods (``method on dataset, loss``) whose search had a budget other than the
    budget most rows had: rows that were not tuned alike (a grid edited halfway)."""
    tuned = tuned_runs(runs)
    if tuned.empty:
        return []
    budgets = budget_keys(tuned)
    usual = budgets.value_counts().index[0]
    odd = tuned[budgets != usual]
    return sorted({f"{r.method} on {r.dataset}, {r.loss}" for r in odd.itertuples()})


def budget_keys(runs: pd.DataFrame) -> pd.Series:
    """What rows tuned alike share: the budget and the settled trials, or the budget alone
    where it gives trials per searched dimension (the trials then differ by design)."""
    budget = (
        runs["tune_budget"].fillna("") if "tune_budget" in runs else pd.Series("", index=runs.index)
    )
    trials = runs["tune_trials"].fillna("").astype(str) if "tune_trials" in runs else ""
    per_dimension = budget.str.contains("per searched dimension")
    return budget.where(per_dimension, budget + " / " + trials)


def fold_report(runs: pd.DataFrame) -> pd.Series:
    """Each run's report of its fold models (:data:`harness.config.catalog.REPORTS`), ``single`` for a run that is
    one model (a one-fold grid's final run, whose ``tune_report`` is missing or empty)."""
    if "tune_report" not in runs:
        return pd.Series("single", index=runs.index)
    kind = runs["tune_report"].fillna("").astype(str)
    return kind.where(kind != "", "single")


def tuning_notes(runs: pd.DataFrame, order: Sequence[str] = ()) -> list[str]:
    """The tuned table's notes: the budget every row was given, which report the cells
    are, and the rows with another budget, if any."""
    tuned = tuned_runs(runs)
    if tuned.empty:
        return []
    budget = tuned["tune_budget"].value_counts().index[0]
    trials = tuned["tune_trials"].value_counts().index[0]
    report = fold_report(tuned).value_counts().index[0]
    what = {
        "separated": "each cell is the mean over seeds of the mean of the fold models' test "
        "metrics (MLRC's separated report)",
        "concatenated": "each cell is the mean over seeds of the test metrics of the fold "
        "models' L2-normalised embeddings concatenated (MLRC's concatenated report; a "
        "test-time re-ranking method such as DIML has no row here: it scores one model's "
        "local features, and its concatenated global embeddings are its base method's, "
        "whose row it would repeat)",
        "single": "each cell is the mean over seeds of one model per seed",
    }[report]
    notes = [
        f"Tuned: every row's hyperparameters chosen by the same budget, {budget} "
        f"({trials} settled trials per study), on the training classes only (Musgrave et al. "
        f"2020, Sec. 4.2); the best setting then trained with each seed: {what}. The chosen "
        f"settings are in the appendix table."
    ]
    notes += search_notes(tuned, order)
    odd = unequal_budget_rows(runs)
    if odd:
        notes.append(
            "NOT TUNED ALIKE: these rows' studies had another budget than the rest (the grid "
            "was edited during its sweep), so they are not comparable: " + "; ".join(odd) + "."
        )
    return notes


def search_notes(tuned: pd.DataFrame, order: Sequence[str] = ()) -> list[str]:
    """Each tuned row's search as it ran (the ``tune_search`` tag): the space's dimensions,
    the settled trials completed / pruned / sampled at random before TPE had its start-up
    trials, and the budget check, rows in ``order`` of their methods (the table's); empty
    for runs recorded without the tag."""
    if "tune_search" not in tuned:
        return []
    rank = {m: i for i, m in enumerate(order)}
    rows, randoms = [], set()
    groups = tuned.groupby(["method", "loss", "dataset"], sort=False)
    for (method, loss, dataset), group in sorted(
        groups, key=lambda g: rank.get(g[0][0], len(rank))
    ):
        text = group["tune_search"].fillna("").iloc[0]
        base = studied_method(group["tune_study"].iloc[0]) if "tune_study" in group else ""
        if base and base != method:  # a test-time method: its base's search
            rows.append(
                f"{method} ({loss}, {dataset}): {base}'s tuned models, its own options not searched"
            )
            continue
        if not text:
            continue
        s = json.loads(text)
        randoms.add((s["random"], s["completed"] + s["pruned"]))
        rows.append(f"{method} ({loss}, {dataset}): {_search_text(s)}")
    if not rows:
        return []
    sampler = "; ".join(
        f"TPE after {r} random trials of {n}"
        if r < n
        else f"all {n} trials random (TPE never fitted)"
        for r, n in sorted(randoms)
    )
    seeds = sorted(
        {json.loads(t).get("search_seed") for t in tuned["tune_search"].fillna("") if t} - {None}
    )
    finals = sorted({str(x) for x in tuned["seed"]}, key=lambda x: (len(x), x))
    apart = (
        f" The search trained with seed {', '.join(map(str, seeds))}, the reported runs with seeds "
        f"{', '.join(finals)}: no reported run repeats a trial."
        if seeds
        else ""
    )
    return [
        f"Search per row (Optuna, {sampler}): dimensions of the searched space; settled trials "
        f"completed / pruned / random; budget check: the rise of the best validation value over the "
        f"last quarter of the trials against the fold noise (the standard error of the best "
        f"trial's mean over its folds), converged when within it. " + "; ".join(rows) + "." + apart
    ]


def _search_text(s: dict) -> str:
    check = (
        "budget check n/a (one fold)"
        if s["converged"] is None
        else f"late gain {s['late_gain']:+.2f} vs fold noise {s['fold_noise']:.2f}: "
        + ("converged" if s["converged"] else "STILL IMPROVING")
    )
    return (
        f"{s['dimensions']} dimensions, {s['completed']} / {s['pruned']} / {s['random']}, {check}"
    )


def studied_method(study: str) -> str:
    """The method a study searched, from its name (``tune:<grid>:<backbone>/<loss>/<method>/
    <dataset>:<key>``): a test-time method's rows carry their base method's study."""
    parts = str(study or "").split(":")
    label = parts[2].split("/") if len(parts) > 3 else []
    return label[2] if len(label) == 4 else ""


def _chosen(params: str) -> dict[str, str]:
    values = json.loads(params or "{}")
    return {k: (f"{v:.3g}" if isinstance(v, float) else str(v)) for k, v in sorted(values.items())}


def settings_appendix(runs: pd.DataFrame, fmt: str = "markdown") -> str:
    """One row per study (backbone, loss, dataset, method): its chosen hyperparameters
    and the best mean validation value of its search, in Markdown or LaTeX (booktabs)."""
    tuned = tuned_runs(runs)
    if tuned.empty:
        return ""
    rows = []
    for key, group in tuned.groupby([*BLOCK, "method"], sort=True):
        first = group.iloc[0]
        history = [v for v in json.loads(first["tune_history"] or "[]") if v is not None]
        chosen = _chosen(first["tune_params"])
        base = studied_method(first.get("tune_study", ""))
        setting = ", ".join(f"{k} = {v}" for k, v in chosen.items()) or "(none searched)"
        if base and base != key[-1]:  # a test-time method: its base method's search
            setting = f"{base}'s setting, evaluated at test time: {setting}"
        rows.append(
            [
                *[str(k) for k in key],
                setting,
                f"{100 * max(history):.2f}" if history else "-",
            ]
        )
    header = ["Backbone", "Loss", "Dataset", "Method", "Chosen setting", "Best val. (%)"]
    if fmt == "latex":

        def tex(text: str) -> str:
            return text.replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")

        lines = [
            r"\begin{table}[t]",
            r"\centering\small",
            r"\caption{Hyperparameters chosen by the search ("
            + tex(str(tuned["tune_budget"].iloc[0]))
            + ")}",
            r"\begin{tabular}{llllp{6cm}r}",
            r"\toprule",
            " & ".join(header).replace("%", r"\%") + r" \\",
            r"\midrule",
            *[" & ".join(tex(c) for c in row) + r" \\" for row in rows],
            r"\bottomrule",
            r"\end{tabular}",
            r"\end{table}",
        ]
        return "\n".join(lines) + "\n"
    out = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join([":---"] * 5 + ["---:"]) + "|",
        *["| " + " | ".join(row) + " |" for row in rows],
    ]
    return (
        f"Hyperparameters chosen by the search ({tuned['tune_budget'].iloc[0]}):\n\n"
        + "\n".join(out)
        + "\n"
    )


def best_so_far(history: Sequence[float | None]) -> list[float]:
    """The running maximum of a study's values by trial number (a pruned trial, None,
    keeps the best so far; NaN before the first finished trial)."""
    best, out = -math.inf, []
    for value in history:
        if value is not None:
            best = max(best, value)
        out.append(best if best > -math.inf else math.nan)
    return out


def search_figure_paths(stem: Path) -> list[Path]:
    return [stem.with_name(stem.name + ".search.png"), stem.with_name(stem.name + ".search.pdf")]


def search_figure_files(runs: pd.DataFrame, stem: Path) -> dict[Path, bytes | str]:
    """The best validation value so far against the trial number, one panel per block
    (backbone, loss, dataset) and one line per method: ``<stem>.search.png`` and ``.pdf``
    by path, rendered, not written (empty for runs that were not tuned)."""

    # deferred: pyplot adds 0.35 s to each command that reads tuned runs without drawing
    # them, and the Agg backend is chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: pyplot loads after the backend is chosen
    from matplotlib.ticker import MaxNLocator

    tuned = tuned_runs(runs)
    if tuned.empty:
        return {}
    blocks = list(tuned.groupby(BLOCK, sort=True))
    figure, axes = plt.subplots(
        1, len(blocks), figsize=(4.2 * len(blocks), 3.4), squeeze=False, constrained_layout=True
    )
    for ax, (key, group) in zip(axes[0], blocks, strict=True):
        _shade_random_trials(ax, group)
        for method, rows in group.groupby("method", sort=True):
            base = studied_method(rows.iloc[0].get("tune_study", ""))
            if base and base != method:  # a test-time method has no search of its own
                continue
            values = best_so_far(json.loads(rows.iloc[0]["tune_history"] or "[]"))
            trials = range(1, len(values) + 1)
            ax.plot(trials, [100 * v for v in values], marker="o", markersize=3, label=method)
        ax.set_title(" / ".join(str(k) for k in key), fontsize=9)
        ax.set_xlabel("trial")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("best validation so far (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    files: dict[Path, bytes | str] = {}
    for path in search_figure_paths(stem):
        buffer = io.BytesIO()
        # No creation date in the file: the same runs give the same bytes.
        figure.savefig(buffer, format=path.suffix[1:], dpi=150, metadata=_NO_DATE[path.suffix])
        files[path] = buffer.getvalue()
    plt.close(figure)
    return files


def _shade_random_trials(ax, block: pd.DataFrame) -> None:
    """Shade the trials every study of the block sampled at random (before TPE's start-up
    trials were settled): a curve that rises there is luck of the draw, not the search."""
    searches = [
        json.loads(t) for t in block.get("tune_search", pd.Series(dtype=object)).fillna("") if t
    ]
    if not searches:
        return
    random = min(s["random"] for s in searches)
    if random:
        ax.axvspan(0.5, random + 0.5, color="0.9", zorder=0, label="random start-up")


_NO_DATE: dict[str, dict] = {".png": {"Software": None}, ".pdf": {"CreationDate": None}}


def tuned_table_paths(stem: Path, fmt: str) -> list[Path]:
    """Every file :func:`tuned_table_files` may write beside a table at ``stem``."""
    ext = ".tex" if fmt == "latex" else ".md"
    return [stem.with_name(f"{stem.name}.settings{ext}"), *search_figure_paths(stem)]


def tuned_table_files(runs: pd.DataFrame, stem: Path, fmt: str) -> dict[Path, bytes | str]:
    """What a tuned table gets beside it: the appendix of chosen settings
    (``<stem>.settings.md`` or ``.tex``) and the best-so-far figure; empty when the runs
    were not tuned."""
    if tuned_runs(runs).empty:
        return {}
    ext = ".tex" if fmt == "latex" else ".md"
    return {
        stem.with_name(stem.name + ".settings" + ext): settings_appendix(runs, fmt),
        **search_figure_files(runs, stem),
    }
