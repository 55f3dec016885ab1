"""The metric names an evaluation takes (:data:`METRICS`), validated into a
:class:`MetricRequest`; the names are listed in :mod:`harness.components.evaluation`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from harness.base.errors import HarnessError, unknown_name
from harness.components.evaluation.clustering import CLUSTERING_METRICS
from harness.components.evaluation.metrics import PAPER_VARIANTS, RETRIEVAL_METRICS

__all__ = ["METRICS", "DEFAULT_METRICS", "MetricRequest", "parse_metrics"]

METRICS = RETRIEVAL_METRICS + CLUSTERING_METRICS
#: Everything except ``ami`` (sklearn's expected mutual information is slow with many classes)
#: and the papers' variants (asked for by name, or added by
#: :func:`~harness.components.evaluation.metrics.with_paper_variants`).
DEFAULT_METRICS = tuple(m for m in METRICS if m != "ami" and m not in PAPER_VARIANTS.values())


@dataclass(frozen=True)
class MetricRequest:
    """Validated metric names: ``names`` among :data:`METRICS` and the Recall@K values."""

    names: frozenset[str]
    recall_k: tuple[int, ...]

    @property
    def retrieval(self) -> frozenset[str]:
        return self.names & set(RETRIEVAL_METRICS)

    @property
    def clustering(self) -> frozenset[str]:
        return self.names & set(CLUSTERING_METRICS)


def parse_metrics(
    metrics: Iterable[str] | None, recall_k: Iterable[int] = (1, 2, 4, 8)
) -> MetricRequest:
    """Names -> :class:`MetricRequest`; ``recall_at_k`` asks for every K in ``recall_k``, ``recall_at_5``
    for K = 5 alone. Unknown names and K < 1 raise :class:`HarnessError`."""
    names: set[str] = set()
    ks: set[int] = set()
    for raw in DEFAULT_METRICS if metrics is None else list(metrics):
        name = raw.strip().lower()
        suffix = name[len("recall_at_") :]
        if name == "recall_at_k":
            ks.update(int(k) for k in recall_k)
        elif name.startswith("recall_at_") and suffix.isdigit():
            ks.add(int(suffix))
        elif name not in METRICS:
            raise unknown_name("metric", raw, [*METRICS, "recall_at_<K>"])
        names.add("recall_at_k" if name.startswith("recall_at_") else name)
    if any(k < 1 for k in ks):
        raise HarnessError(f"Recall@K needs K >= 1, got {sorted(ks)}")
    return MetricRequest(frozenset(names), tuple(sorted(ks)))
