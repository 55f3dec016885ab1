"""Published numbers: the transcribed CSVs (``results/published/``), where they are found,
the rows a table compares, the values flagged in their notes, and reproduced cells joined
with them."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.base.errors import HarnessError
from harness.reports.tables.columns import CELL_COLUMNS, KEYS

__all__ = [
    "parse_published_row",
    "published_dir",
    "locate_published",
    "EXCLUDED_FLAGS",
    "FOOTNOTED_FLAGS",
    "load_published",
    "PublishedValues",
    "published_values",
    "attach_published",
    "published_deltas",
]


def parse_published_row(spec: str) -> tuple[str, str]:
    """``"diablo@entries=16"`` -> ``("diablo", "entries=16")``; no ``@``: the empty setting."""
    method, _, setting = spec.partition("@")
    if not method:
        raise HarnessError(
            f"published row '{spec}' must look like method@setting (setting may be empty)"
        )
    return method, setting


def _select_published_rows(
    frame: pd.DataFrame, rows: Mapping[str, Sequence[str]], path: Path
) -> pd.DataFrame:
    """Each reproduced method's published rows, renamed to it: ``rows`` maps a reproduced
    method to ``"method@setting"`` specs matched against the CSV's ``method`` and
    ``setting`` columns (a CSV without ``setting`` has the empty one). Rows no spec names
    are dropped; a spec that matches nothing is an error (a typo would drop a column)."""
    setting = (
        frame["setting"].astype(str) if "setting" in frame else pd.Series("", index=frame.index)
    )
    picked = []
    for reproduced, specs in rows.items():
        for spec in specs:
            method, wanted = parse_published_row(spec)
            match = frame[(frame["method"] == method) & (setting == wanted)]
            if match.empty:
                known = sorted({f"{m}@{s}" for m, s in zip(frame["method"], setting, strict=True)})
                raise HarnessError(
                    f"{path} has no row '{spec}' (for {reproduced}) in the chosen tables; "
                    f"rows there: {', '.join(known)}"
                )
            picked.append(match.assign(method=reproduced))
    return pd.concat(picked, ignore_index=True) if picked else frame.iloc[0:0]


def published_dir() -> Path:
    """The transcribed published numbers: ``results/published/`` of the source checkout
    (the source of truth), else the copy a wheel installs as package data
    (``harness/_published``, mapped in pyproject.toml)."""
    package = Path(__file__).resolve().parents[2]  # harness/
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
    described = sorted(
        {
            f"{r['method']} {r['dataset']} {r['metric']} (table {r['table']}): {r['notes']}"
            for _, r in excluded.iterrows()
        }
    )
    if described:
        print(
            f"tables: {len(excluded)} published value(s) of {Path(path).name} not compared: "
            + "; ".join(described),
            file=sys.stderr,
        )
    kept.attrs["excluded"] = described
    return kept


def load_published(
    path: Path, tables: Iterable[str] | None = None, rows: Mapping[str, Sequence[str]] | None = None
) -> pd.DataFrame:
    """The transcribed CSV (``table,backbone,loss,method,dataset,metric,value``), filtered.

    ``rows`` (a grid's ``[published] rows``): ``{reproduced method: ["method@setting"]}``,
    the published rows beside each reproduced method, told apart by the CSV's ``setting``
    column (e.g. DIABLO's N = 8 and N = 16 rows of one loss); without it every row keeps
    its own method and the ``setting`` column is not read.

    A row whose ``notes`` start with ``column_mislabelled:`` is left out (one line on
    stderr; ``attrs["excluded"]``); the ``note`` column keeps the other flagged notes
    (``ksweep: ...``) for the table's footnotes."""
    path = locate_published(path)
    frame = _read_csv(path)
    if tables:
        frame = _choose_tables(frame, [str(t) for t in tables], path)
    if rows:
        frame = _select_published_rows(frame, rows, path)
    frame = _drop_excluded(frame, path)
    _refuse_several_values(frame, path)
    out = frame[[*KEYS, "metric", "value", "note"]].astype({"value": float}).reset_index(drop=True)
    out.attrs["excluded"] = frame.attrs.get("excluded", [])
    return out


def _read_csv(path: Path) -> pd.DataFrame:
    if not Path(path).is_file():
        raise HarnessError(f"published table file not found: {path}")
    frame = pd.read_csv(path, dtype={"table": str}, keep_default_na=False)
    missing = {"table", *KEYS, "metric", "value"} - set(frame.columns)
    if missing:
        raise HarnessError(f"{path} lacks the columns {', '.join(sorted(missing))}")
    return frame


def _choose_tables(frame: pd.DataFrame, wanted: list[str], path: Path) -> pd.DataFrame:
    unknown = sorted(set(wanted) - set(frame["table"]))
    if unknown:
        raise HarnessError(
            f"{path} has no table {', '.join(unknown)}; tables there: "
            f"{', '.join(sorted(set(frame['table'])))}"
        )
    return frame[frame["table"].isin(wanted)]


def _refuse_several_values(frame: pd.DataFrame, path: Path) -> None:
    """One published value per cell: rows of several tables or settings that land on one
    cell would make the comparison ambiguous."""
    twice = frame[frame.duplicated([*KEYS, "metric"], keep=False)]
    if twice.empty:
        return
    first = twice.iloc[0]
    others = [c for c in frame.columns if c not in (*KEYS, "metric", "value", "note")]
    raise HarnessError(
        f"{path} holds several values for one cell, e.g. {first['method']} + {first['loss']} on "
        f"{first['dataset']}, {first['metric']} ({len(twice)} rows in tables "
        f"{', '.join(sorted(set(twice['table'])))} differ only in {', '.join(others)}); "
        f"choose one table with --table, or name the rows beside each method with --published-row "
        f"(a grid's [published] rows)"
    )


@dataclass(frozen=True, eq=False)
class PublishedValues:
    """The published values a table compares (None: no CSV), the descriptions of those left
    out and the notes the compared ones are flagged with."""

    values: pd.DataFrame | None = None
    excluded: tuple[str, ...] = ()
    flagged: tuple[str, ...] = ()


def published_values(
    path: Path | None,
    tables: Iterable[str] = (),
    rows: Mapping[str, Sequence[str]] | None = None,
    renamed: Mapping[str, str] | None = None,
) -> PublishedValues:
    """:func:`load_published` for a table, with each metric ``renamed`` (``{published metric:
    reproduced metric}``) to the reproduced variant it sits beside."""
    if not path:
        return PublishedValues()
    values = load_published(path, tables, rows)
    excluded, flagged = values.attrs.get("excluded", []), sorted(set(values["note"]) - {""})
    if renamed:
        values = values.assign(metric=values["metric"].map(lambda m: renamed.get(m, m)))
    return PublishedValues(values, tuple(excluded), tuple(flagged))


def attach_published(cells: pd.DataFrame, published: pd.DataFrame | None) -> pd.DataFrame:
    """Outer-join reproduced cells with published values (column ``published``), so a
    published row without runs still appears (reproduced mean NaN). A published value
    sits beside every setting of its method."""
    if published is None or published.empty:
        out = cells.copy()
        out["published"] = math.nan
        return out[CELL_COLUMNS]
    pub = published.rename(columns={"value": "published"})
    if cells.empty:
        out = pub.assign(
            setting="",
            mean=math.nan,
            half_width=math.nan,
            std=math.nan,
            n=0,
            flagged=False,
            code_flagged=False,
            reproduced=False,
        )
    else:
        out = pub.merge(cells, on=[*KEYS, "metric"], how="outer")
    out["setting"] = out["setting"].fillna("")
    out["n"] = out["n"].fillna(0).astype(int)
    for flag in ("flagged", "code_flagged", "reproduced"):
        out[flag] = out[flag].astype("boolean").fillna(False).astype(bool)
    return out[CELL_COLUMNS].reset_index(drop=True)


def published_deltas(
    runs: pd.DataFrame, published: pd.DataFrame | None, metrics: Iterable[str]
) -> dict[str, dict[str, float]]:
    """Each run's distance to the published value of its cell, in percentage points (the
    unit of the papers' tables): ``{run id: {metric: 100 x test value - published}}``.
    A run is matched as the table matches its cell (backbone, loss, method, dataset and
    metric, every setting beside its method's value); a run without a published value or
    without the metric is left out."""
    if published is None or published.empty or runs.empty:
        return {}
    deltas: dict[str, dict[str, float]] = {}
    for metric in metrics:
        column = f"test_{metric}"
        values = published.loc[published["metric"] == metric, [*KEYS, "value"]]
        if column not in runs or values.empty:
            continue
        matched = runs[["run_id", *KEYS, column]].merge(values, on=KEYS).dropna()
        for run_id, reproduced, value in zip(
            matched["run_id"], matched[column], matched["value"], strict=True
        ):
            deltas.setdefault(str(run_id), {})[metric] = 100.0 * float(reproduced) - float(value)
    return deltas
