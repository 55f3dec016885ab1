"""The results table printed at the end of ``run``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from harness.base.metric_keys import HEADLINE
from harness.reports.stats import t_half_width

__all__ = ["format_results", "run_note", "SHORT_NAMES"]

SHORT_NAMES = {
    "precision_at_1": "P@1",
    "r_precision": "RP",
    "mean_average_precision_at_r": "MAP@R",
    "map_at_c": "mAP@C",
    "nmi": "NMI",
    "ami": "AMI",
    "f1": "F1",
}


def _short(metric: str) -> str:
    if metric.startswith("global_"):  # the cosine ranking before a method's re-ranking
        return "cos:" + _short(metric.removeprefix("global_"))
    if metric.startswith("recall_at_"):
        return "R@" + metric.removeprefix("recall_at_")
    return SHORT_NAMES.get(metric, metric)


def format_results(records: list[dict]) -> str:
    """One row per (method, loss): mean and, with several seeds, the half-width of the 95%
    Student t-interval over seeds (as in the tables), in %. The papers' metric variants
    (``*_query_in_r``) stay in the tracking store and the tables, out of this summary."""
    if not records:
        return "(no runs)"
    # Union of the records' metrics, in first-seen order (re-ranking methods add cos: columns).
    metrics = [
        m
        for m in dict.fromkeys(m for r in records for m in r["metrics"])
        if not m.endswith("_query_in_r")
    ]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["dataset"], r["method"], r["loss"])].append(r)
    header = ["dataset", "method", "loss", "seeds"] + [_short(m) for m in metrics]
    rows = [
        [dataset, method, loss, str(len(runs)), *(_cell(runs, m) for m in metrics)]
        for (dataset, method, loss), runs in groups.items()
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i >= 3 else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
    if any(len(runs) > 1 for runs in groups.values()):
        out.append("mean ± half-width of the 95% Student t-interval over seeds")
    return "\n".join(out + _footer(records))


def _cell(runs: list[dict], metric: str) -> str:
    """The mean of ``metric`` over the seeds' runs in %, with the half-width of its 95%
    interval when more than one run has it; "-" when none has."""
    values = np.array([r["metrics"].get(metric, np.nan) for r in runs]) * 100
    if np.isnan(values).all():
        return "-"
    cell = f"{values.mean():.2f}"
    finite = values[~np.isnan(values)]
    if len(finite) > 1:
        cell += f"±{t_half_width(finite):.2f}"
    return cell


def _footer(records: list[dict]) -> list[str]:
    """The lines under the table: the protocol and its model selection, the runs'
    deviations from the protocol and from the papers."""
    out = [
        f"protocol {records[0]['protocol']} (fingerprint {records[0]['fingerprint']}), "
        f"model selection: {records[0]['selection']}"
        + ("  [TEST-SET SELECTION: paper mode]" if records[0]["selection"] == "test-paper" else "")
    ]
    deviations = sorted({d for r in records for d in r.get("deviations", [])})
    if deviations:
        out.append("deviations: " + "; ".join(deviations))
    paper_deviations = sorted({d for r in records for d in r.get("paper_deviations", [])})
    if paper_deviations:
        out.append("deviations from the papers or their code:")
        out += [f"  {line}" for line in paper_deviations]
    return out


def run_note(
    *,
    method: str,
    dataset: str,
    protocol: str,
    selection: str,
    metrics: dict[str, float],
    selected_epoch: int,
    deviations: list[str],
    paper_deviations: list[str],
    init_from: str = "",
    evaluate_only: bool = False,
    model: str = "",
    figures: Sequence[str] = (),
) -> str:
    """The Markdown summary a run shows as its description in the MLflow UI, read in three
    places: the run's page (which shows its first lines and folds the rest under *Show
    more*), its logged model's page, and the tooltip of a run in the UI's charts (the first
    two lines, as raw text). So it opens with plain text, no Markdown: what ran and its
    headline test metrics in % with two decimals (:func:`_headline`); then the deviations
    from the paper, counted and named (``paper_deviations``: one ``name: text`` line each),
    and the protocol's, which the run's tag ``deviations`` holds; then how the weights were
    selected; then what to look at: the logged ``model`` (its name) and the ``figures``
    (artifact paths); the paper's deviations in full last."""
    if evaluate_only:
        source = f", of the trained run {init_from}, whose weights this run evaluates"
    else:
        source = f", trained from run {init_from}" if init_from else ""
    names = [d.split(":", 1)[0] for d in paper_deviations]
    lines = [
        f"{method} on {dataset}, protocol {protocol}. Test: {_headline(metrics)}.",
        "",
        "Deviations from the paper: "
        + (f"{len(names)} ({', '.join(names)}; below)" if names else "none")
        + ". From the protocol (tag deviations): "
        + ("; ".join(deviations) if deviations else "none")
        + ".",
        "",
        f"Model selection: {selection}, epoch {selected_epoch}{source}.",
    ]
    look = [f"the model {model} (Models tab)"] if model else []
    look += [f"{', '.join(figures)} (Artifacts tab)"] if figures else []
    if look:
        lines += ["", f"Look at: {'; '.join(look)}."]
    if paper_deviations:
        lines += ["", "Deviations from the paper:", "", *[f"- {d}" for d in paper_deviations]]
    return "\n".join(lines) + "\n"


def _headline(metrics: dict[str, float]) -> str:
    """The headline metrics in % with two decimals (``P@1 45.90 %, MAP@R 13.20 %``). R@1
    shares P@1's entry when the two agree, as they do for retrieval of the nearest
    neighbour: the same number twice reads as a mistake."""
    entries = [(_short(m), f"{100 * metrics[m]:.2f} %") for m in HEADLINE if m in metrics]
    names = [name for name, _ in entries]
    if {"P@1", "R@1"} <= set(names):
        p, r = names.index("P@1"), names.index("R@1")
        if entries[p][1] == entries[r][1]:
            entries[p] = ("P@1 = R@1", entries[p][1])
            del entries[r]
    return ", ".join(f"{name} {value}" for name, value in entries) or "none"
