"""Paper-style comparison tables from the tracking store alone (no retraining).

``python -m harness table --experiment NAME [--published CSV --table 3]`` reads the
FINISHED runs of one or more MLflow experiments, groups them by (backbone, loss,
method, dataset), and prints mean +- std over seeds of each ``test_<metric>`` in
percent, with the published number and the difference beside it.

Three steps, each a plain function so that each is easy to test:

1. :func:`load_runs` (tracking store -> one row per run, the newest per seed),
2. :func:`summarize` (runs -> one row per cell, refusing blocks that mix protocol
   fingerprints) and :func:`attach_published`,
3. :func:`render_latex` / :func:`render_markdown` (cells -> string; pure).

Layout (A-grouping Table 3): rows are blocks of backbone + loss, one row per
method inside a block; columns are dataset x metric. The best reproduced mean of
each block and column is bold. A dagger marks cells whose runs carry protocol
deviations or were selected on the test set.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

from .errors import HarnessError

__all__ = ["add_table_parser", "cmd_table", "load_runs", "summarize", "load_published",
           "parse_published_row", "attach_published", "render_latex", "render_markdown", "write_atomic",
           "DEFAULT_METRICS", "CELL_COLUMNS"]

#: Metrics of A-grouping's Tables 3 and 4 (Roth's class-wise mAP is ``map_at_c``).
DEFAULT_METRICS = ("recall_at_1", "recall_at_2", "nmi", "f1", "map_at_c")
KEYS = ["backbone", "loss", "method", "dataset"]
BLOCK = ["backbone", "loss", "dataset"]
#: Columns of the long "cell" frame the renderers take.
CELL_COLUMNS = [*KEYS, "metric", "mean", "std", "n", "flagged", "published"]

METRIC_LABELS = {"recall_at_1": "R@1", "recall_at_2": "R@2", "recall_at_4": "R@4",
                 "recall_at_8": "R@8", "recall_at_10": "R@10", "recall_at_100": "R@100",
                 "recall_at_16": "R@16", "recall_at_32": "R@32", "recall_at_1000": "R@1000",
                 "nmi": "NMI", "f1": "F1", "map_at_c": "mAP@C", "precision_at_1": "P@1",
                 "r_precision": "RP", "mean_average_precision_at_r": "MAP@R"}
DATASET_LABELS = {"cub200": "CUB-200-2011", "cars196": "Cars196", "sop": "SOP", "inshop": "In-Shop",
                  "synthetic": "synthetic", "fashion-mnist": "Fashion-MNIST"}
BACKBONE_LABELS = {"googlenet": "GoogLeNet", "resnet50": "ResNet-50", "resnet18": "ResNet-18",
                   "efficientnet_lite0": "EfficientNet-Lite0"}
LOSS_LABELS = {"contrastive": "Contrastive", "triplet": "Triplet", "binomial_deviance": "Binomial deviance",
               "margin": "Margin", "multi_similarity": "Multi-similarity", "proxy_nca": "ProxyNCA",
               "proxy_anchor": "ProxyAnchor", "arcface": "ArcFace", "normalized_softmax": "Normalized softmax",
               # DIML Table 1's other rows (Roth et al. 2020's loss names)
               "triplet_random": "Triplet (random)", "triplet_semihard": "Triplet (semihard)",
               "triplet_softhard": "Triplet (softhard)", "triplet_distance": "Triplet (distance)",
               "angular": "Angular", "npair": "N-pair", "generalized_lifted": "Generalized lifted",
               "quadruplet": "Quadruplet", "snr": "SNR", "histogram": "Histogram"}
#: Row order inside a block: baselines before the methods built on them.
METHOD_LABELS = {"plain": "Baseline", "diml": "DIML", "ngrouping": "N-grouping", "mgrouping": "M-grouping",
                 "ggrouping": "G-grouping", "cgrouping": "C-grouping", "agrouping": "A-grouping",
                 "diablo": "+ DIABLO (N = 8)", "diablo_n16": "+ DIABLO (N = 16)"}


def _label(table: dict[str, str], name: str) -> str:
    return table.get(name, name)


# ------------------------------------------------------------------------ loading


def load_runs(experiments: Sequence[str]) -> pd.DataFrame:
    """One row per FINISHED run of ``experiments``: keys, fingerprint, flags and test metrics.

    Columns: ``run_id, experiment, backbone, loss, method, dataset, seed, fingerprint,
    deviations, test_set_selection`` and one column per ``test_<metric>`` (fractions).
    """
    import mlflow

    from .tracking import tracking_uri

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    ids = {}
    for name in experiments:
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            known = sorted(e.name for e in mlflow.search_experiments())
            raise HarnessError(f"no MLflow experiment '{name}' in {uri}; experiments there: "
                               f"{', '.join(known) or 'none'}")
        ids[exp.experiment_id] = name
    frame = mlflow.search_runs(experiment_ids=list(ids), filter_string="attributes.status = 'FINISHED'",
                               output_format="pandas")
    columns = ["run_id", "experiment", *KEYS, "seed", "fingerprint", "deviations", "test_set_selection",
               "method_revision"]
    if frame.empty:
        return pd.DataFrame(columns=columns)

    def col(name: str, default: str = "") -> pd.Series:
        return frame[name] if name in frame else pd.Series(default, index=frame.index)

    runs = pd.DataFrame({
        "run_id": frame["run_id"],
        "experiment": frame["experiment_id"].map(ids),
        "backbone": col("params.protocol.backbone.name"),
        "loss": col("tags.loss"),
        "method": col("tags.method"),
        "dataset": col("tags.dataset"),
        "seed": col("tags.seed"),
        "fingerprint": col("tags.fingerprint"),
        "deviations": col("tags.deviations", "none").fillna("none"),
        "test_set_selection": col("tags.test_set_selection", "False").fillna("False") == "True",
        "method_revision": pd.to_numeric(col("tags.method_revision", "1"), errors="coerce").fillna(1).astype(int),
    })
    for name in frame.columns:
        if name.startswith("metrics.test_"):
            runs[name.removeprefix("metrics.")] = frame[name]
    return _newest_per_seed(runs, frame["start_time"])


def _newest_per_seed(runs: pd.DataFrame, start_time: pd.Series) -> pd.DataFrame:
    """One run per (method, protocol, seed): runs of an older method revision and older
    runs of the same seed are superseded, so that ``n`` counts seeds of the current code
    and the spread is over seeds, not over repeats of one."""
    cell = [*KEYS, "fingerprint"]
    current = runs[runs["method_revision"] == runs.groupby(cell)["method_revision"].transform("max")]
    order = start_time.loc[current.index].sort_values(kind="stable").index
    newest = current.loc[order].drop_duplicates([*cell, "seed"], keep="last")
    if len(newest) < len(runs):
        print(f"tables: {len(runs) - len(newest)} run(s) superseded by a newer run or method revision "
              f"of the same method, protocol and seed", file=sys.stderr)
    return newest.sort_index().reset_index(drop=True)


def _check_fingerprints(runs: pd.DataFrame) -> None:
    for (backbone, loss, dataset), block in runs.groupby(BLOCK, sort=False):
        prints = sorted(set(block["fingerprint"]))
        if len(prints) > 1:
            a, b = prints[0], prints[1]
            na, nb = (int((block["fingerprint"] == p).sum()) for p in (a, b))
            raise HarnessError(
                f"refusing to compare runs of different protocols in block {backbone} + {loss} on "
                f"{dataset}: protocol fingerprints {a} ({na} runs) and {b} ({nb} runs); "
                f"table one protocol at a time (one experiment, or delete the odd runs from it)")


def summarize(runs: pd.DataFrame, metrics: Sequence[str] = DEFAULT_METRICS) -> pd.DataFrame:
    """Runs -> cells (``CELL_COLUMNS`` without ``published``): mean and sample std over
    seeds in percent, the number of runs, and ``flagged`` when any run of the cell has
    deviations or test-set selection. Raises if a block mixes protocol fingerprints."""
    if runs.empty:
        return pd.DataFrame(columns=CELL_COLUMNS[:-1])
    _check_fingerprints(runs)
    rows = []
    for key, cell in runs.groupby(KEYS, sort=False):
        flagged = bool(((cell["deviations"] != "none") | cell["test_set_selection"]).any())
        for metric in metrics:
            column = f"test_{metric}"
            values = (cell[column].dropna() * 100.0) if column in cell else pd.Series(dtype=float)
            if values.empty:
                continue
            rows.append({**dict(zip(KEYS, key, strict=True)), "metric": metric,
                         "mean": float(values.mean()),
                         "std": float(values.std(ddof=1)) if len(values) > 1 else math.nan,
                         "n": len(values), "flagged": flagged})
    return pd.DataFrame(rows, columns=CELL_COLUMNS[:-1])


def parse_published_row(spec: str) -> tuple[str, str]:
    """``"diablo@entries=16"`` -> ``("diablo", "entries=16")``; no ``@``: the empty setting."""
    method, _, setting = spec.partition("@")
    if not method:
        raise HarnessError(f"published row '{spec}' must look like method@setting (setting may be empty)")
    return method, setting


def _select_published_rows(frame: pd.DataFrame, rows: dict[str, Sequence[str]], path: Path) -> pd.DataFrame:
    """Each reproduced method's published rows, renamed to it: ``rows`` maps a reproduced
    method to ``"method@setting"`` specs matched against the CSV's ``method`` and
    ``setting`` columns (a CSV without ``setting`` has the empty one). Rows no spec names
    are dropped; a spec that matches nothing is an error (a typo would drop a column)."""
    setting = frame["setting"].astype(str) if "setting" in frame else pd.Series("", index=frame.index)
    picked = []
    for reproduced, specs in rows.items():
        for spec in specs:
            method, wanted = parse_published_row(spec)
            match = frame[(frame["method"] == method) & (setting == wanted)]
            if match.empty:
                known = sorted({f"{m}@{s}" for m, s in zip(frame["method"], setting, strict=True)})
                raise HarnessError(f"{path} has no row '{spec}' (for {reproduced}) in the chosen tables; "
                                   f"rows there: {', '.join(known)}")
            picked.append(match.assign(method=reproduced))
    return pd.concat(picked, ignore_index=True) if picked else frame.iloc[0:0]


def published_dir() -> Path:
    """The transcribed published numbers: ``results/published/`` of the source checkout
    (the source of truth), else the copy a wheel installs as package data
    (``harness/_published``, mapped in pyproject.toml)."""
    package = Path(__file__).resolve().parent
    checkout = package.parent / "results" / "published"
    return checkout if checkout.is_dir() else package / "_published"


def locate_published(path: Path | str) -> Path:
    """``path`` as given when it exists; else a relative ``results/published/<name>.csv``
    (what grids name) or a bare ``<name>.csv`` / ``<name>`` from :func:`published_dir`, so
    tables work from any working directory and from an installed package."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    parts = path.parts
    if parts[:2] == ("results", "published") or len(parts) == 1:
        shipped = published_dir() / Path(parts[-1]).with_suffix(".csv").name
        if shipped.is_file():
            return shipped
    return path


#: Flags a published row's ``notes`` may start with (``flag: why``). ``column_mislabelled``:
#: the printed column's heading names another metric than its values are (kept in the CSV
#: as printed, never compared). ``ksweep``: computed by a path of the authors' code that
#: differs from the method's definition (compared, and the table's footnote says so).
EXCLUDED_FLAGS = ("column_mislabelled",)
FOOTNOTED_FLAGS = ("ksweep",)


def _note_flag(note: str) -> str:
    head = note.split(":", 1)[0].strip()
    return head if head in (*EXCLUDED_FLAGS, *FOOTNOTED_FLAGS) else ""


def _drop_excluded(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    """Rows flagged ``column_mislabelled`` out, with one line on stderr naming them; the
    descriptions stay in ``frame.attrs["excluded"]`` for the table's footnote."""
    notes = frame["notes"] if "notes" in frame.columns else pd.Series("", index=frame.index)
    flags = notes.map(_note_flag)
    excluded = frame[flags.isin(EXCLUDED_FLAGS)]
    kept = frame[~flags.isin(EXCLUDED_FLAGS)].copy()
    kept["note"] = [n if _note_flag(n) else "" for n in notes[kept.index]]
    described = sorted({f"{r['method']} {r['dataset']} {r['metric']} (table {r['table']}): {r['notes']}"
                        for _, r in excluded.iterrows()})
    if described:
        print(f"tables: {len(excluded)} published value(s) of {Path(path).name} not compared: "
              + "; ".join(described), file=sys.stderr)
    kept.attrs["excluded"] = described
    return kept


def load_published(path: Path, tables: Iterable[str] | None = None,
                   rows: dict[str, Sequence[str]] | None = None) -> pd.DataFrame:
    """The transcribed CSV (``table,backbone,loss,method,dataset,metric,value``), filtered.

    ``rows`` (a grid's ``[published] rows``): ``{reproduced method: ["method@setting"]}``,
    the published rows beside each reproduced method, told apart by the CSV's ``setting``
    column (e.g. DIABLO's N = 8 and N = 16 rows of one loss); without it every row keeps
    its own method and the ``setting`` column is not read.

    A row whose ``notes`` start with ``column_mislabelled:`` is left out (one line on
    stderr; ``attrs["excluded"]``); the ``note`` column keeps the other flagged notes
    (``ksweep: ...``) for the table's footnotes."""
    path = locate_published(path)
    if not Path(path).is_file():
        raise HarnessError(f"published table file not found: {path}")
    frame = pd.read_csv(path, dtype={"table": str}, keep_default_na=False)
    missing = {"table", *KEYS, "metric", "value"} - set(frame.columns)
    if missing:
        raise HarnessError(f"{path} lacks the columns {', '.join(sorted(missing))}")
    if tables:
        wanted = [str(t) for t in tables]
        unknown = sorted(set(wanted) - set(frame["table"]))
        if unknown:
            raise HarnessError(f"{path} has no table {', '.join(unknown)}; tables there: "
                               f"{', '.join(sorted(set(frame['table'])))}")
        frame = frame[frame["table"].isin(wanted)]
    if rows:
        frame = _select_published_rows(frame, rows, path)
    frame = _drop_excluded(frame, path)
    twice = frame[frame.duplicated([*KEYS, "metric"], keep=False)]
    if not twice.empty:
        first = twice.iloc[0]
        others = [c for c in frame.columns if c not in (*KEYS, "metric", "value", "note")]
        raise HarnessError(
            f"{path} holds several values for one cell, e.g. {first['method']} + {first['loss']} on "
            f"{first['dataset']}, {first['metric']} ({len(twice)} rows in tables "
            f"{', '.join(sorted(set(twice['table'])))} differ only in {', '.join(others)}); "
            f"choose one table with --table, or name the rows beside each method with --published-row "
            f"(a grid's [published] rows)")
    out = frame[[*KEYS, "metric", "value", "note"]].astype({"value": float}).reset_index(drop=True)
    out.attrs["excluded"] = frame.attrs.get("excluded", [])
    return out


def attach_published(cells: pd.DataFrame, published: pd.DataFrame | None) -> pd.DataFrame:
    """Outer-join reproduced cells with published values (column ``published``), so a
    published row without runs still appears (reproduced mean NaN)."""
    if published is None or published.empty:
        out = cells.copy()
        out["published"] = math.nan
        return out[CELL_COLUMNS]
    pub = published.rename(columns={"value": "published"})
    out = pub.merge(cells, on=[*KEYS, "metric"], how="outer") if not cells.empty else pub.assign(
        mean=math.nan, std=math.nan, n=0, flagged=False)
    out["n"] = out["n"].fillna(0).astype(int)
    out["flagged"] = out["flagged"].astype("boolean").fillna(False).astype(bool)
    return out[CELL_COLUMNS].reset_index(drop=True)


# ---------------------------------------------------------------------- rendering


def _order(values: Iterable, known: Sequence = ()) -> list:
    """Distinct values: those in ``known`` first in its order, then the rest as they appear."""
    seen = list(dict.fromkeys(v for v in values if isinstance(v, str | tuple)))
    rank = {v: i for i, v in enumerate(known)}
    return sorted(seen, key=lambda v: (rank.get(v, len(rank)), seen.index(v)))


def _layout(cells: pd.DataFrame, metrics: Sequence[str] | None):
    """Row blocks, row methods and (dataset, metric) columns in first-appearance order."""
    if cells.empty:
        raise HarnessError("nothing to tabulate: no finished runs and no published values")
    backbones, losses = _order(cells["backbone"], list(BACKBONE_LABELS)), _order(cells["loss"], list(LOSS_LABELS))
    blocks = _order(zip(cells["backbone"], cells["loss"], strict=True),
                    [(b, lo) for b in backbones for lo in losses])
    methods = _order(cells["method"], list(METHOD_LABELS))
    datasets = _order(cells["dataset"], list(DATASET_LABELS))
    present = _order(cells["metric"])
    metric_order = [m for m in (metrics or present) if m in present]
    columns = [(d, m) for d in datasets for m in metric_order
               if ((cells["dataset"] == d) & (cells["metric"] == m)).any()]
    return blocks, methods, datasets, columns


def _best(cells: pd.DataFrame) -> set[tuple]:
    """Keys (backbone, loss, method, dataset, metric) of the best reproduced mean per
    block and column (ties: all of them)."""
    best = set()
    have = cells.dropna(subset=["mean"])
    for _, group in have.groupby([*BLOCK, "metric"], sort=False):
        top = round(group["mean"].max(), 2)
        for _, row in group[group["mean"].round(2) == top].iterrows():
            best.add((row["backbone"], row["loss"], row["method"], row["dataset"], row["metric"]))
    return best


def _fmt(value: float) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def _cell_text(row: pd.Series | None, bold: bool, *, latex: bool, most_seeds: int = 0) -> str:
    """``mean ± std`` (bold when best), a dagger when flagged, the seed count when it is
    below the table's most, then ``/ published (difference)``."""
    dash = "--" if latex else "–"
    if row is None:
        return dash
    mean, std, pub, flagged = row["mean"], row["std"], row["published"], bool(row["flagged"])
    if math.isnan(mean):
        ours = dash
    else:
        ours = _fmt(mean)
        if bold:
            ours = f"\\textbf{{{ours}}}" if latex else f"**{ours}**"
        if not math.isnan(std):
            ours += f"$\\pm${std:.2f}" if latex else f" ± {std:.2f}"
        if flagged:
            ours += "$^\\dagger$" if latex else "†"
        if 0 < row["n"] < most_seeds:
            ours += f"$_{{n={row['n']}}}$" if latex else f" (n={row['n']})"
    if math.isnan(pub):
        return ours
    diff = "" if math.isnan(mean) else f" ({round(mean, 2) - pub:+.2f})"
    return f"{ours} / {pub:.2f}{diff}"


def _footnotes(cells: pd.DataFrame, deviations: Sequence[str], latex: bool) -> list[str]:
    ns = sorted(set(int(n) for n in cells["n"] if n))
    seeds = ("over " + (f"{ns[0]} seed{'s' if ns[0] != 1 else ''}" if len(ns) == 1
                        else f"{ns[0]}-{ns[-1]} seeds")) if ns else ""
    pm = "$\\pm$" if latex else "±"
    published = " / published value (reproduced minus published)" if cells["published"].notna().any() else ""
    fewer = (" n: the number of seeds where a cell has fewer than the others."
             if ns and ns[0] < ns[-1] else "")
    notes = [f"Cells: reproduced mean {pm} sample std {seeds} (percent){published}. "
             f"Bold: best reproduced mean of its block and column.{fewer}"]
    if cells["flagged"].any():
        dagger = "$^\\dagger$" if latex else "†"
        what = "; ".join(deviations) if deviations else "see the runs' deviations tags"
        what = _latex_escape(what) if latex else what
        notes.append(f"{dagger} runs with protocol deviations or test-set model selection ({what}).")
    return notes


def _rows(cells: pd.DataFrame, metrics: Sequence[str] | None):
    blocks, methods, datasets, columns = _layout(cells, metrics)
    best = _best(cells)
    index = {(r.backbone, r.loss, r.method, r.dataset, r.metric): r for r in cells.itertuples(index=False)}
    body = []
    for backbone, loss in blocks:
        in_block = cells[(cells["backbone"] == backbone) & (cells["loss"] == loss)]
        rows = []
        for method in [m for m in methods if (in_block["method"] == m).any()]:
            row = []
            for dataset, metric in columns:
                key = (backbone, loss, method, dataset, metric)
                rec = index.get(key)
                row.append((None if rec is None else pd.Series(rec._asdict()), key in best))
            rows.append((method, row))
        body.append(((backbone, loss), rows))
    return body, datasets, columns


_LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                   "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _latex_escape(text: str) -> str:
    """Plain text to LaTeX: every special character escaped, ``->`` as an arrow."""
    return r"$\to$".join("".join(_LATEX_SPECIALS.get(ch, ch) for ch in part) for part in text.split("->"))


def render_latex(cells: pd.DataFrame, *, metrics: Sequence[str] | None = None, caption: str = "",
                 deviations: Sequence[str] = ()) -> str:
    """Cells (``CELL_COLUMNS``) -> a booktabs LaTeX table (needs ``\\usepackage{booktabs}``)."""
    body, datasets, columns = _rows(cells, metrics)
    most_seeds = int(cells["n"].max()) if len(cells) else 0
    width = 1 + len(columns)
    lines = ["\\begin{table*}[t]", "\\centering", "\\scriptsize"]
    if caption:
        lines.append(f"\\caption{{{_latex_escape(caption)}}}")
    lines += [f"\\begin{{tabular}}{{l{'c' * len(columns)}}}", "\\toprule"]
    spans, start = [], 2
    head = ["Method"]
    for d in datasets:
        k = sum(1 for c in columns if c[0] == d)
        if k:
            head.append(f"\\multicolumn{{{k}}}{{c}}{{{_latex_escape(_label(DATASET_LABELS, d))}}}")
            spans.append(f"\\cmidrule(lr){{{start}-{start + k - 1}}}")
            start += k
    lines.append(" & ".join(head) + " \\\\")
    lines.append(" ".join(spans))
    lines.append(" & ".join(["", *(_latex_escape(_label(METRIC_LABELS, m)) for _, m in columns)]) + " \\\\")
    for (backbone, loss), rows in body:
        lines.append("\\midrule")
        title = f"{_label(BACKBONE_LABELS, backbone)} + {_label(LOSS_LABELS, loss)}"
        lines.append(f"\\multicolumn{{{width}}}{{l}}{{\\emph{{{_latex_escape(title)}}}}} \\\\")
        for method, row in rows:
            cells_text = [_cell_text(rec, bold, latex=True, most_seeds=most_seeds) for rec, bold in row]
            lines.append(" & ".join([_latex_escape(_label(METHOD_LABELS, method)), *cells_text]) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    for note in _footnotes(cells, deviations, latex=True):
        lines.append(f"\\par\\smallskip\\parbox{{\\textwidth}}{{\\footnotesize {note}}}")
    lines.append("\\end{table*}")
    return "\n".join(lines) + "\n"


def render_markdown(cells: pd.DataFrame, *, metrics: Sequence[str] | None = None, caption: str = "",
                    deviations: Sequence[str] = ()) -> str:
    """Cells (``CELL_COLUMNS``) -> a GitHub Markdown table with footnotes."""
    body, _, columns = _rows(cells, metrics)
    most_seeds = int(cells["n"].max()) if len(cells) else 0
    header = ["Method", *(f"{_label(DATASET_LABELS, d)} {_label(METRIC_LABELS, m)}" for d, m in columns)]
    lines = [f"**{caption}**", ""] if caption else []
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join([":---", *[":---:"] * len(columns)]) + "|"]
    for (backbone, loss), rows in body:
        title = f"{_label(BACKBONE_LABELS, backbone)} + {_label(LOSS_LABELS, loss)}"
        lines.append("| " + " | ".join([f"*{title}*", *[""] * len(columns)]) + " |")
        for method, row in rows:
            lines.append("| " + " | ".join([_label(METHOD_LABELS, method),
                                            *(_cell_text(rec, bold, latex=False, most_seeds=most_seeds)
                                              for rec, bold in row)]) + " |")
    lines.append("")
    lines += _footnotes(cells, deviations, latex=False)
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write a table atomically (see :mod:`harness.atomic`)."""
    from .atomic import atomic_write_text

    atomic_write_text(path, text)


# ---------------------------------------------------------------------------- CLI


def build_table(experiments: Sequence[str], *, fmt: str = "latex", published: Path | None = None,
                tables: Sequence[str] = (), metrics: Sequence[str] | None = None,
                caption: str = "", published_rows: dict[str, Sequence[str]] | None = None) -> str:
    """Tracking store -> table text (what ``cmd_table`` writes)."""
    runs = load_runs(experiments)
    pub = load_published(published, tables, published_rows) if published else None
    excluded = pub.attrs.get("excluded", []) if pub is not None else []
    wanted = list(metrics) if metrics else (_order(pub["metric"]) if pub is not None else list(DEFAULT_METRICS))
    if pub is not None:
        pub = pub[pub["metric"].isin(wanted)]
    cells = attach_published(summarize(runs, wanted), pub)
    deviations = sorted({d for d, s in zip(runs["deviations"], runs["test_set_selection"], strict=True)
                         if d != "none"} | ({"test-set model selection"} if runs["test_set_selection"].any() else set()))
    render = render_latex if fmt == "latex" else render_markdown
    caption = caption or (f"Reproduced (experiment {', '.join(experiments)})"
                          + (f" vs published (table {', '.join(tables)})" if tables else ""))
    text = render(cells, metrics=wanted, caption=caption, deviations=deviations)
    return _with_published_notes(text, excluded, [] if pub is None else sorted(set(pub["note"]) - {""}),
                                 latex=fmt == "latex")


def _with_published_notes(text: str, excluded: Sequence[str], notes: Sequence[str], *, latex: bool) -> str:
    """The rendered table with a footnote per flagged published note and one naming the
    published values left out (``column_mislabelled``)."""
    lines = [f"Published values not compared: {'; '.join(excluded)}."] if excluded else []
    lines += [f"Published values marked {note}" for note in notes]
    if not lines:
        return text
    if latex:
        lines = [f"\\par\\smallskip\\parbox{{\\textwidth}}{{\\footnotesize {_latex_escape(line)}}}"
                 for line in lines]
        head, end = text.rstrip("\n").rsplit("\n", 1)  # end: \\end{table*}
        return "\n".join([head, *lines, end]) + "\n"
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"


def cmd_table(args: argparse.Namespace) -> int:
    tables = [t.strip() for t in (args.table or "").split(",") if t.strip()]
    if tables and not args.published:
        raise HarnessError("--table needs --published (the CSV the table number refers to)")
    metrics = [m.strip() for m in args.metrics.split(",")] if args.metrics else None
    rows: dict[str, list[str]] = {}
    for item in args.published_row or []:
        reproduced, sep, spec = item.partition("=")
        if not sep or not reproduced.strip():
            raise HarnessError(f"--published-row '{item}' must look like METHOD=PUBLISHED_METHOD@SETTING")
        parse_published_row(spec.strip())
        rows.setdefault(reproduced.strip(), []).append(spec.strip())
    if rows and not args.published:
        raise HarnessError("--published-row needs --published (the CSV the rows are in)")
    text = build_table(args.experiment, fmt=args.format, published=args.published, tables=tables,
                       metrics=metrics, caption=args.caption or "", published_rows=rows or None)
    name = args.name or "+".join(args.experiment)
    out = args.out or Path("results") / "tables" / f"{name}.{'tex' if args.format == 'latex' else 'md'}"
    write_atomic(out, text)
    print(text)
    print(f"written to {out}", file=sys.stderr)
    return 0


def add_table_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("table", help="paper-style table (LaTeX or Markdown) from finished MLflow runs")
    p.add_argument("--experiment", action="append", required=True,
                   help="MLflow experiment to read (repeat for several)")
    p.add_argument("--format", choices=("latex", "markdown"), default="latex")
    p.add_argument("--out", type=Path, help="output file (default results/tables/<name>.tex|.md)")
    p.add_argument("--name", help="table name for the default output path (default: the experiment)")
    p.add_argument("--published", type=Path, help="CSV of published numbers, e.g. results/published/agrouping.csv")
    p.add_argument("--table", help="table number(s) in the published CSV, e.g. 3 or 3,4")
    p.add_argument("--published-row", action="append", metavar="METHOD=PUBLISHED@SETTING",
                   help="the published rows beside a reproduced method, by the CSV's method and setting "
                   "columns, e.g. diablo_n16=diablo@entries=16 (repeat; an empty setting: diablo=diablo@); "
                   "given, rows not named are left out")
    p.add_argument("--metrics", help="comma-separated metrics (default: the published table's, "
                   f"else {','.join(DEFAULT_METRICS)})")
    p.add_argument("--caption")
    p.set_defaults(func=cmd_table)
    return p
