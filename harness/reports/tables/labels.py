"""What a table prints for registry names: metrics, datasets, backbones, losses, and each
method's row label as its plugin declares it."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from harness.methods import METHODS

__all__ = [
    "METRIC_LABELS",
    "DATASET_LABELS",
    "BACKBONE_LABELS",
    "LOSS_LABELS",
    "label",
    "method_labels",
    "recorded_options",
    "method_order",
    "block_label",
    "row_label",
    "all_labels",
]

METRIC_LABELS = {
    "recall_at_1": "R@1",
    "recall_at_2": "R@2",
    "recall_at_4": "R@4",
    "recall_at_8": "R@8",
    "recall_at_10": "R@10",
    "recall_at_100": "R@100",
    "recall_at_16": "R@16",
    "recall_at_32": "R@32",
    "recall_at_1000": "R@1000",
    "nmi": "NMI",
    "f1": "F1",
    "map_at_c": "mAP@C",
    "precision_at_1": "P@1",
    "r_precision": "RP",
    "mean_average_precision_at_r": "MAP@R",
    # DIML's released evaluation counts the query in R (harness.components.evaluation.metrics)
    "r_precision_query_in_r": "RP (query in R)",
    "mean_average_precision_at_r_query_in_r": "MAP@R (query in R)",
}
DATASET_LABELS = {
    "cub200": "CUB-200-2011",
    "cars196": "Cars196",
    "sop": "SOP",
    "inshop": "In-Shop",
    "synthetic": "synthetic",
    "synthetic-closeup": "synthetic (close-up)",
    "fashion-mnist": "Fashion-MNIST",
}
BACKBONE_LABELS = {
    "googlenet": "GoogLeNet",
    "resnet50": "ResNet-50",
    "resnet18": "ResNet-18",
    "efficientnet_lite0": "EfficientNet-Lite0",
}
LOSS_LABELS = {
    "contrastive": "Contrastive",
    "triplet": "Triplet",
    "binomial_deviance": "Binomial deviance",
    "margin": "Margin",
    "multi_similarity": "Multi-similarity",
    "proxy_nca": "ProxyNCA",
    "proxy_anchor": "ProxyAnchor",
    "arcface": "ArcFace",
    "normalized_softmax": "Normalized softmax",
    # DIML Table 1's other rows (Roth et al. 2020's loss names)
    "triplet_random": "Triplet (random)",
    "triplet_semihard": "Triplet (semihard)",
    "triplet_softhard": "Triplet (softhard)",
    "triplet_distance": "Triplet (distance)",
    "angular": "Angular",
    "npair": "N-pair",
    "generalized_lifted": "Generalized lifted",
    "quadruplet": "Quadruplet",
    "snr": "SNR",
    "histogram": "Histogram",
}


def label(labels: Mapping[str, str], name: str) -> str:
    """``name``'s label in ``labels``; a name it lacks is its own label."""
    return labels.get(name, name)


def method_labels(
    methods: Iterable[str], recorded: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, str]:
    """Each method's row label, as its plugin declares it (:meth:`harness.methods.MethodEntry.display_name`)
    from the options its runs recorded (``recorded``: ``{method: {option: value}}``, the
    rest at their defaults); a name the registry does not know (a published row of
    another paper) is its own label."""
    # Imported when called: the plugins pull in torch, which reading a table never needs otherwise.

    recorded = recorded or {}
    return {m: METHODS.get(m).display_name(recorded.get(m)) if m in METHODS else m for m in methods}


def recorded_options(runs: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """``{method: options}`` for each method whose runs all recorded the same method options
    (``params.method.<option>``, in the ``options`` column); a method whose runs differ is
    left out (its rows are labelled by registry name and setting)."""
    out: dict[str, Any] = {}
    if "options" not in runs:
        return out
    for method, group in runs.groupby("method", sort=False):
        distinct = set(group["options"].fillna("{}"))
        if len(distinct) == 1:
            out[method] = json.loads(distinct.pop() or "{}")
    return out


def method_order(baseline: str) -> list[str]:
    """Row order inside a block: the baseline row, then the methods in the order their
    plugins register them (each plugin registers its own baselines before its method)."""

    return list(dict.fromkeys([baseline, *METHODS.registered()]))


def block_label(backbone: str, loss: str) -> str:
    """A block's heading: ``ResNet-50 + Margin``."""
    return f"{label(BACKBONE_LABELS, backbone)} + {label(LOSS_LABELS, loss)}"


def row_label(method: str, setting: str, labels: Mapping[str, str]) -> str:
    """The paper's label for a method's row (``labels``, :func:`method_labels`); the method's
    registered name and what tells the row apart when it has a setting (a paper label may
    name an option, "N = 8")."""
    return f"{method} [{setting}]" if setting else labels[method]


def all_labels(
    cells: pd.DataFrame, tests: pd.DataFrame | None, given: Mapping[str, str] | None
) -> dict[str, str]:
    """``given`` labels, completed with the plugins' default ones for every other method
    the cells and tests name."""
    named = set(cells["method"].dropna()) | (set() if tests is None else set(tests["baseline"]))
    return {**method_labels(sorted(named - set(given or {}))), **(given or {})}
