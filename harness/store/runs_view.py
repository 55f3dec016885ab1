"""The saved view *Metric learning* of an experiment's runs page in the MLflow UI: which
method is best, at a glance.

The MLflow UI keeps a runs page's columns, sort order and charts in the browser; a new
user sees no metric column at all. A saved view is an experiment tag
(``mlflow.sharedViewState.<key>``) holding that state, which the UI's Views menu lists
and the URL parameter ``viewStateShareKey=<key>`` opens; ``harness ui`` also makes it the
page's state in a browser that holds none (:mod:`harness.store.ui_app`).

The view's table shows one row per run: its name, the headline test metrics in %
(their display copies, :func:`harness.base.metric_keys.display_copies`), then its method,
dataset, loss and seed, best P@1 first; the headline columns come first, so that they fit
a 1000 px window. Its charts open on two sections: the headline test metrics, one dot per
run above its method's name (the MLflow UI's bar charts name no run, and its scatter
charts leave a y axis 80 px of labels, a x axis the room they need), and the curves, the
validation split's selection metric in % per epoch, ``train/loss`` and beside it
``train/relative_loss`` (each run's loss over its first: losses of different scales on one
chart), and ``train/lr`` (log scale) per step. Every other metric keeps its chart in its group's section,
collapsed; a group no run has gets no section.

The state's fields are MLflow's (its ``EXPERIMENT_PAGE_UI_STATE_FIELDS`` and search
facets, MLflow 3.17); the UI takes those it knows and ignores :data:`VERSION_FIELD`, which
marks a view the harness wrote: a view a user saved over from the UI loses the mark and is
left alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from harness.base.metric_keys import (
    GROUPS,
    HEADLINE,
    LOSS_KEY,
    READABLE,
    RELATIVE_LOSS_KEY,
    display_key,
    split_key,
)

__all__ = [
    "VIEW_KEY",
    "VIEW_NAME",
    "TAG_PREFIX",
    "VERSION",
    "VERSION_FIELD",
    "HEADLINE_SECTION",
    "CURVES_SECTION",
    "view_state",
    "view_tag",
    "outdated",
    "saved_state",
]

VIEW_KEY, VIEW_NAME = "metric-learning", "Metric learning"
#: The experiment tag prefix of MLflow's saved views.
TAG_PREFIX = "mlflow.sharedViewState."
#: Which form of the view the harness writes; a harness view of an older form is rewritten.
VERSION = 4
VERSION_FIELD = "harnessViewVersion"
#: The state fields of the first form of the view, which carried no version.
_FIRST_FORM = {"selectedColumns", "orderByKey", "orderByAsc"}
#: The names of the view's two open chart sections.
HEADLINE_SECTION = "Headline test metrics in %: one dot per run, by method"
CURVES_SECTION = "Curves: validation in % per epoch, training per step"
#: Run columns (tags) that say what a run is, with their widths in pixels: wide enough for
#: ``diablo_dimension_post``, ``fashion-mnist`` and ``multi_similarity``.
_RUN_COLUMNS = {"method": 140, "dataset": 100, "loss": 110, "seed": 50}
_METRIC_WIDTH = 76
#: The columns MLflow pins left: the run's name and its start, narrowed.
_PINNED = {"attributes.`Run Name`": 180, "runDateAndNestInfo": 110}
#: MLflow's chart sections of metrics without a group and of ``system/`` metrics.
_MODEL_SECTION, _SYSTEM_SECTION = "Model metrics", "System metrics"
#: The selection metric whose validation curve the view draws where the runs' is none of
#: the headline metrics.
_DEFAULT_SELECTION = "mean_average_precision_at_r"


def _column(kind: str, key: str) -> str:
    """MLflow's id of a runs-table column (its ``makeCanonicalSortKey``)."""
    return f"{kind}.`{key}`"


def _chart(uuid: str, section: str, **config) -> dict:
    return {
        "uuid": uuid,
        "metricSectionId": section,
        "runsCountToCompare": 100,
        "deleted": False,
        "isGenerated": False,
        **config,
    }


def _line(key: str, section: str, *, log: bool = False) -> dict:
    """A line chart of ``key`` against the step (a linear or a logarithmic y axis)."""
    return _chart(
        f"chart-{key}",
        section,
        type="LINE",
        metricKey=key,
        selectedMetricKeys=[key],
        scaleType="log" if log else "linear",
        xAxisKey="step",
        range={},
    )


def _charts(selection: str, metric_keys: set[str]) -> list[dict]:
    """The headline dot plots, the four curves, and hidden charts of the other display
    copies: the UI makes a chart of its own for every metric no chart names."""
    headline, curves = "section-headline", "section-curves"
    charts = [
        _chart(
            f"chart-{READABLE[name]}",
            headline,
            type="SCATTER",
            xaxis={"key": "method", "type": "PARAM"},
            yaxis={"key": READABLE[name], "type": "METRIC"},
        )
        for name in HEADLINE
    ]
    chosen = display_key("val", selection if selection in HEADLINE else _DEFAULT_SELECTION)
    charts += [
        _line(str(chosen), curves),
        _line(LOSS_KEY, curves),
        _line(RELATIVE_LOSS_KEY, curves),
        _line("train/lr", curves, log=True),
    ]
    copies = {display_key(group, name) for group in ("test", "val") for name in HEADLINE}
    for key in sorted({str(c) for c in copies} | {k for k in metric_keys if "/" not in k}):
        if key != chosen:
            charts.append(
                {**_chart(f"hidden-{key}", headline, type="BAR", metricKey=key), "deleted": True}
            )
    return charts


def _sections(metric_keys: set[str]) -> list[dict]:
    """The two open sections, then one collapsed section per group the runs log, as the UI
    names them (``system/`` metrics: MLflow's *System metrics*)."""
    groups = {part[0] for key in metric_keys if (part := split_key(key)) is not None}
    names = [g for g in GROUPS if g in groups and g != "system"]
    names += [_SYSTEM_SECTION] if "system" in groups else []
    sections = [
        {
            "uuid": "section-headline",
            "name": HEADLINE_SECTION,
            "display": True,
            "columns": 2,
            "cardHeight": 320,
        },
        {"uuid": "section-curves", "name": CURVES_SECTION, "display": True, "columns": 2},
    ]
    sections += [{"uuid": f"section-{name}", "name": name, "display": False} for name in names]
    return [{**section, "isReordered": True} for section in sections]


def view_state(metric_keys: Iterable[str] = (), selection: str = _DEFAULT_SELECTION) -> dict:
    """The view's state (table and charts), as the UI reads it, for runs that log
    ``metric_keys`` and select their weights on validation metric ``selection`` (a bare
    name: ``mean_average_precision_at_r``)."""
    keys = set(metric_keys)
    metric_columns = [_column("metrics", READABLE[name]) for name in HEADLINE]
    run_columns = [_column("tags", key) for key in _RUN_COLUMNS]
    return {
        "selectedColumns": metric_columns + run_columns,
        # The UI applies the widths of the columns in this order only. Duration is no
        # column MLflow lets a view hide: it goes last.
        "columnOrder": [*_PINNED, *metric_columns, *run_columns, "duration"],
        "columnWidths": {
            **_PINNED,
            **dict.fromkeys(metric_columns, _METRIC_WIDTH),
            **{_column("tags", key): width for key, width in _RUN_COLUMNS.items()},
        },
        "orderByKey": metric_columns[0],
        "orderByAsc": False,
        "runsHiddenMode": "SHOW_ALL",
        "compareRunSections": _sections(keys),
        "compareRunCharts": _charts(selection, keys),
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
        "runListHidden": True,
        VERSION_FIELD: VERSION,
    }


def view_tag(state: dict | None = None) -> tuple[str, str]:
    """The experiment tag of the view ``state`` (default: :func:`view_state` of no runs),
    in the envelope MLflow's UI saves views in (name, times, and the state as JSON)."""
    now = int(time.time() * 1000)
    envelope = {
        "name": VIEW_NAME,
        "createdAt": now,
        "updatedAt": now,
        "state": json.dumps(view_state() if state is None else state),
    }
    return TAG_PREFIX + VIEW_KEY, json.dumps(envelope)


def saved_state(value: str | None) -> dict | None:
    """The state in the experiment's view tag ``value``; None when absent or unreadable
    (a view the UI saved compressed)."""
    if value is None:
        return None
    try:
        state = json.loads(json.loads(value)["state"])
    except (ValueError, KeyError, TypeError):
        return None
    return state if isinstance(state, dict) else None


def outdated(value: str | None, wanted: dict | None = None) -> bool:
    """Whether the experiment's view tag ``value`` (None: absent) should be written anew:
    absent, a view the harness wrote in an older form, or (given the ``wanted`` state) a
    harness view that differs from it. A view saved from the UI carries no version (the UI
    may compress its state) and stays as the user saved it."""
    if value is None:
        return True
    state = saved_state(value)
    if state is None:
        return False
    version = state.get(VERSION_FIELD)
    if isinstance(version, int):
        return version < VERSION or (wanted is not None and state != wanted)
    return set(state) <= _FIRST_FORM
