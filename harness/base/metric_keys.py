"""The names under which runs log their metrics: ``<group>/<name>``.

MLflow's UI groups charts and the metric-column picker by the part before the first
``/``, so every metric of a run falls in one of :data:`GROUPS`:

- ``test/``: the selected weights on the test split (logged at the selected epoch);
- ``val/``: the validation split, each epoch it is evaluated (model selection);
- ``paper_selection/``: the test split each epoch, when the protocol selects on it as
  the authors' code does (``selection.mode = "test-paper"``);
- ``train/``: the training loss and its terms;
- ``explain/``: faithfulness scores of the explanations and group attention mass;
- ``system/``: throughput, wall time and memory.

The headline metrics of the test and validation splits are logged once more outside the
groups, as percentages rounded to two decimals (:func:`display_copies`): the test split's
under short keys (:data:`READABLE`: ``P at 1``, ``R at 1``, ``MAP at R``, ``NMI``), the
validation split's with ``val`` before them (``val MAP at R``, per epoch), for the MLflow
UI's columns and charts; MLflow allows no ``@`` or ``%`` in a key. Tables and records read
the grouped fractions, never these.

The UI lists a group's metrics alphabetically. The protocol's headline metrics (P@1,
R@1, MAP@R, NMI) carry a rank digit after the slash (``test/1_precision_at_1``), which
sorts them first, in that order, in every group; :func:`metric_key` and
:func:`split_key` are the one place that knows it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "TABLE_METRICS",
    "GROUPS",
    "HEADLINE",
    "READABLE",
    "DISPLAY_GROUPS",
    "metric_key",
    "split_key",
    "group_metrics",
    "readable",
    "display_key",
    "display_copies",
    "LOSS_KEY",
    "RELATIVE_LOSS_KEY",
]

#: A table's default metrics: A-grouping's Tables 3 and 4 (Roth's class-wise mAP is
#: ``map_at_c``), then MAP@R (Musgrave et al. 2020, Sec. 3.2: R-precision averaged over the
#: first R ranks). Here, below the reports, so that ``table``'s parser names them without
#: loading the tables' modules.
TABLE_METRICS = (
    "recall_at_1",
    "recall_at_2",
    "nmi",
    "f1",
    "map_at_c",
    "mean_average_precision_at_r",
)

GROUPS = ("test", "val", "paper_selection", "train", "explain", "system")
#: The protocol's headline metrics, in the order tables and the UI show them.
HEADLINE = ("precision_at_1", "recall_at_1", "mean_average_precision_at_r", "nmi")
#: The short key of each headline metric's readable copy (a percentage, two decimals).
READABLE = {
    "precision_at_1": "P at 1",
    "recall_at_1": "R at 1",
    "mean_average_precision_at_r": "MAP at R",
    "nmi": "NMI",
}
#: The training loss per step, and the same curve divided by the run's first logged value:
#: losses of different scales (AVSL's 3.7 against a margin loss's 0.2) compared on one chart.
LOSS_KEY, RELATIVE_LOSS_KEY = "train/loss", "train/relative_loss"
#: The groups whose headline metrics get a display copy, and the prefix of its key.
DISPLAY_GROUPS = {"test": "", "val": "val "}


def metric_key(group: str, name: str) -> str:
    """The logged key of metric ``name`` in ``group``: ``metric_key("test", "nmi")`` is
    ``test/4_nmi``, ``metric_key("train", "loss")`` is ``train/loss``."""
    if group not in GROUPS:
        raise ValueError(f"unknown metric group {group!r}; valid: {', '.join(GROUPS)}")
    if name in HEADLINE:
        return f"{group}/{HEADLINE.index(name) + 1}_{name}"
    return f"{group}/{name}"


def split_key(key: str) -> tuple[str, str] | None:
    """``(group, name)`` of a logged key (the inverse of :func:`metric_key`); None for a
    key outside the groups (e.g. one logged by MLflow itself)."""
    group, slash, rest = key.partition("/")
    if not slash or group not in GROUPS or not rest:
        return None
    rank, underscore, name = rest.partition("_")
    if underscore and rank.isdigit() and name in HEADLINE:
        return group, name
    return group, rest


def group_metrics(metrics: Mapping[str, float], group: str) -> dict[str, float]:
    """The metrics of ``group`` among logged ``metrics``, by bare name
    (``{"test/1_precision_at_1": 0.5}`` -> ``{"precision_at_1": 0.5}`` for ``"test"``)."""
    found = {}
    for key, value in metrics.items():
        parts = split_key(key)
        if parts is not None and parts[0] == group:
            found[parts[1]] = value
    return found


def readable(scores: Mapping[str, float]) -> dict[str, float]:
    """The readable copies of the headline metrics among ``scores`` (bare names, fractions):
    ``{"precision_at_1": 0.45902}`` -> ``{"P at 1": 45.9}``. A column of these reads at a
    glance, where the fractions show as ``0.45902777...``."""
    return {READABLE[name]: round(100 * scores[name], 2) for name in HEADLINE if name in scores}


def display_key(group: str, name: str) -> str | None:
    """The key of the display copy (a percentage) of headline metric ``name`` of ``group``:
    ``P at 1`` for the test split's P@1, ``val MAP at R`` for the validation split's MAP@R;
    None for a metric or group without one."""
    if group not in DISPLAY_GROUPS or name not in READABLE:
        return None
    return DISPLAY_GROUPS[group] + READABLE[name]


def display_copies(metrics: Mapping[str, float]) -> dict[str, float]:
    """The display copies of the headline metrics among logged ``metrics`` (keys as logged,
    fractions), each a percentage rounded to two decimals:
    ``{"val/3_mean_average_precision_at_r": 0.0229}`` -> ``{"val MAP at R": 2.29}``."""
    copies = {}
    for key, value in metrics.items():
        parts = split_key(key)
        copy = display_key(*parts) if parts is not None else None
        if copy is not None:
            copies[copy] = round(100 * value, 2)
    return copies
