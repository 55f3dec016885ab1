"""The saved view *Metric learning* of an experiment's runs page in the MLflow UI: which
method is best, at a glance.

The MLflow UI keeps a runs page's columns, sort order and charts in the browser; a new
user sees no metric column at all. A saved view is an experiment tag
(``mlflow.sharedViewState.<key>``) holding that state, which the UI's Views menu lists
and the URL parameter ``viewStateShareKey=<key>`` opens. The harness's view shows one row
per run with its method, dataset, loss and seed and the headline test metrics as
percentages (:data:`harness.base.metric_keys.READABLE`), best P@1 first, narrow enough for
a 1400 px window; its charts open on the ``test`` section with the headline metrics as
bars, every run shown.

The state's fields are MLflow's (its ``EXPERIMENT_PAGE_UI_STATE_FIELDS`` and search
facets); the UI takes those it knows and ignores :data:`VERSION_FIELD`, which marks a view
the harness wrote: a view a user saved over from the UI loses the mark and is left alone.
"""

from __future__ import annotations

import json
import time

from harness.base.metric_keys import GROUPS, HEADLINE, READABLE

__all__ = [
    "VIEW_KEY",
    "VIEW_NAME",
    "VERSION",
    "VERSION_FIELD",
    "view_state",
    "view_tag",
    "outdated",
]

VIEW_KEY, VIEW_NAME = "metric-learning", "Metric learning"
#: The experiment tag prefix of MLflow's saved views.
TAG_PREFIX = "mlflow.sharedViewState."
#: Which form of the view the harness writes; a harness view of an older form is rewritten.
VERSION = 2
VERSION_FIELD = "harnessViewVersion"
#: The state fields of the first form of the view, which carried no version.
_FIRST_FORM = {"selectedColumns", "orderByKey", "orderByAsc"}
#: Run columns (tags) that say what a run is, with their widths in pixels: wide enough for
#: ``diablo_dimension_post``, ``fashion-mnist`` and ``multi_similarity``.
_RUN_COLUMNS = {"method": 140, "dataset": 100, "loss": 110, "seed": 50}
_METRIC_WIDTH = 80
#: The columns MLflow pins left: the run's name (MLflow's width) and its start, narrowed.
_PINNED = {"attributes.`Run Name`": 190, "runDateAndNestInfo": 130}
#: MLflow's chart sections of metrics without a group and of ``system/`` metrics.
_MLFLOW_SECTIONS = ("Model metrics", "System metrics")


def _column(kind: str, key: str) -> str:
    """MLflow's id of a runs-table column (its ``makeCanonicalSortKey``)."""
    return f"{kind}.`{key}`"


def _charts() -> tuple[list[dict], list[dict]]:
    """The chart sections, ``test`` first and MLflow's own two last, and the headline
    metrics' bar charts in ``test``. Each section counts as reordered, so the UI appends
    the charts it makes for the other metrics in the order it meets them instead of
    splicing them between these."""
    names = [g for g in GROUPS if g != "system"] + list(_MLFLOW_SECTIONS)
    sections = [
        {"uuid": f"section-{name}", "name": name, "display": True, "isReordered": True}
        for name in names
    ]
    charts = [
        {
            "uuid": f"chart-{READABLE[name]}",
            "type": "BAR",
            "metricKey": READABLE[name],
            "metricSectionId": "section-test",
            "runsCountToCompare": 100,
            "deleted": False,
            "isGenerated": False,
        }
        for name in HEADLINE
    ]
    return sections, charts


def view_state() -> dict:
    """The view's state (table and charts), as the UI reads it."""
    run_columns = [_column("tags", key) for key in _RUN_COLUMNS]
    metric_columns = [_column("metrics", READABLE[name]) for name in HEADLINE]
    sections, charts = _charts()
    return {
        "selectedColumns": run_columns + metric_columns,
        # The UI applies the widths of the columns in this order only. Duration is no
        # column MLflow lets a view hide: it goes after the metrics.
        "columnOrder": [*_PINNED, *run_columns, *metric_columns, "duration"],
        "columnWidths": {
            **_PINNED,
            **{_column("tags", key): width for key, width in _RUN_COLUMNS.items()},
            **dict.fromkeys(metric_columns, _METRIC_WIDTH),
        },
        "orderByKey": metric_columns[0],
        "orderByAsc": False,
        "runsHiddenMode": "SHOW_ALL",
        "compareRunSections": sections,
        "compareRunCharts": charts,
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
        VERSION_FIELD: VERSION,
    }


def view_tag() -> tuple[str, str]:
    """The experiment tag of the view, in the envelope MLflow's UI saves views in (name,
    times, and the state as JSON)."""
    now = int(time.time() * 1000)
    envelope = {
        "name": VIEW_NAME,
        "createdAt": now,
        "updatedAt": now,
        "state": json.dumps(view_state()),
    }
    return TAG_PREFIX + VIEW_KEY, json.dumps(envelope)


def outdated(value: str | None) -> bool:
    """Whether the experiment's view tag ``value`` (None: absent) should be written anew:
    absent, or a view the harness wrote in an older form. A view saved from the UI carries
    no version (the UI may compress its state) and stays as the user saved it."""
    if value is None:
        return True
    try:
        state = json.loads(json.loads(value)["state"])
    except (ValueError, KeyError, TypeError):
        return False
    if not isinstance(state, dict):
        return False
    version = state.get(VERSION_FIELD)
    if isinstance(version, int):
        return version < VERSION
    return set(state) <= _FIRST_FORM
