"""Retrieval metrics from ranked neighbour lists: one implementation for the whole project.

Every metric here is a mean over queries of a per-query score computed from
``hits`` (Q x k bool: is the i-th neighbour of the query's class?). Because the
input is a ranked list, the same code scores a plain cosine ranking and a
re-ranked one (DIML, AVSL plugins).

Definitions (R = number of relevant reference items: the query's class size
minus one for same-source retrieval, the gallery count of its class for
query/gallery retrieval):

``precision_at_1``
    hits[0]; pytorch-metric-learning ``AccuracyCalculator`` ``precision_at_1``.
``recall_at_K``
    hit rate: 1 if any of the top K is relevant (the field's Recall@K, e.g.
    Oh Song et al. 2016); PML has no such metric.
``r_precision``
    (relevant among the top R) / R; PML ``r_precision`` (Musgrave et al. 2020).
``mean_average_precision_at_r``
    (1/R) * sum_{i<=R} hits[i] * P@i, with P@i = (relevant among the top i) / i;
    PML ``mean_average_precision_at_r`` (Musgrave et al. 2020, MAP@R).
``map_at_c``
    Roth et al. 2020 ``mAP_c`` (Revisiting Training Strategies and
    Generalization Performance in Deep Metric Learning, ``metrics/mAP_c.py``):
    with c = the query's class size *including itself*, take the top-c
    non-self neighbours and score (1/c) * sum_{i<=c} hits[i] * P@i, then
    average over queries (Roth loops over classes but averages the per-query
    values, so every query weighs the same). Compared
    with MAP@R the window and the divisor are one larger (c = R + 1), so a
    perfect ranking scores (c - 1) / c, not 1. Implemented as Roth defines it,
    except that (a) the query is removed by index (Roth drops column 0 of the
    search, which is wrong when a duplicate ranks first) and (b) queries with
    no other member of their class are excluded like in every other metric
    (Roth scores them 0). For query/gallery retrieval no self exists and c = R,
    so ``map_at_c`` equals ``mean_average_precision_at_r`` there.

``r_precision_query_in_r``, ``mean_average_precision_at_r_query_in_r``
    DIML's released evaluation (wl-zhao/DIML ``evaluation/metrics.py``
    ``get_metrics_rank``, called from ``evaluation/eval_diml.py``): the query is
    pushed to the end of its own ranking (similarity -100) but ``num_pos``
    counts every item of its class, the query included, so R' = n = R + 1 and
    a perfect ranking scores (n - 1) / n. RP' = (relevant among the top R') / R',
    MAP@R' = (1/R') * sum_{i<=R'} hits[i] * P@i. Computed from the same ranking
    as the standard metrics; for query/gallery retrieval there is no self to
    count and they equal ``r_precision`` / ``mean_average_precision_at_r``.
    Numerically MAP@R' equals ``map_at_c`` (same window and divisor); it is kept
    under its own name so that a table says which paper's definition it shows.

Queries with R = 0 ("lone" queries) are excluded from every metric and counted
in ``num_lone_queries``; PML's ``AccuracyCalculator`` does the same.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

__all__ = [
    "RETRIEVAL_METRICS",
    "PER_QUERY_SCORES",
    "PAPER_VARIANTS",
    "with_paper_variants",
    "relevant_counts",
    "first_hit_rank",
    "r_precision_scores",
    "average_precision_scores",
    "RetrievalScores",
    "retrieval_metrics",
    "NO_HIT",
]

RETRIEVAL_METRICS = (
    "precision_at_1",
    "recall_at_k",
    "r_precision",
    "mean_average_precision_at_r",
    "map_at_c",
    "r_precision_query_in_r",
    "mean_average_precision_at_r_query_in_r",
)
#: Per-query scores kept by :class:`RetrievalScores` (each a mean over queries in the result).
PER_QUERY_SCORES = (
    "r_precision",
    "mean_average_precision_at_r",
    "map_at_c",
    "r_precision_query_in_r",
    "mean_average_precision_at_r_query_in_r",
)
#: Each standard metric's variant as a paper's released evaluation defines it (computed from
#: the same ranking, stored beside it, never under the standard name).
PAPER_VARIANTS = {
    "r_precision": "r_precision_query_in_r",
    "mean_average_precision_at_r": "mean_average_precision_at_r_query_in_r",
}
#: Metrics whose window is c = R + 1 (same-source) instead of R.
_WINDOW_C = ("map_at_c", "r_precision_query_in_r", "mean_average_precision_at_r_query_in_r")
#: :func:`first_hit_rank` of a list without any relevant item.
NO_HIT = np.iinfo(np.int64).max


def with_paper_variants(metrics: Sequence[str]) -> tuple[str, ...]:
    """``metrics`` plus the :data:`PAPER_VARIANTS` of those among them (what a run's test
    evaluation computes: the variants are not protocol settings, so no fingerprint changes)."""
    return tuple(
        dict.fromkeys([*metrics, *(PAPER_VARIANTS[m] for m in metrics if m in PAPER_VARIANTS)])
    )


def relevant_counts(
    query_labels: np.ndarray, reference_labels: np.ndarray, *, same_source: bool
) -> np.ndarray:
    """R per query (Q,) int64: reference items of the query's class, minus the query itself if same-source."""
    classes, counts = np.unique(reference_labels, return_counts=True)
    if len(classes) == 0:
        return np.zeros(len(query_labels), np.int64)
    pos = np.clip(np.searchsorted(classes, query_labels), 0, len(classes) - 1)
    r = np.where(classes[pos] == query_labels, counts[pos], 0).astype(np.int64)
    return r - 1 if same_source else r


def first_hit_rank(hits: np.ndarray) -> np.ndarray:
    """0-based rank of the first relevant neighbour (Q,) int64, or ``NO_HIT`` when none of the k is."""
    if hits.shape[1] == 0:
        return np.full(hits.shape[0], NO_HIT, np.int64)
    return np.where(hits.any(1), hits.argmax(1), NO_HIT)


def _within(hits: np.ndarray, n: np.ndarray) -> np.ndarray:
    """hits restricted to each row's first ``n`` columns (Q x min(max n, k))."""
    width = int(min(n.max(initial=0), hits.shape[1]))
    return hits[:, :width] & (np.arange(width)[None, :] < n[:, None])


def r_precision_scores(hits: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Per-query R-Precision (Q,) float64: relevant among the top ``r`` / ``r`` (r > 0)."""
    return _within(hits, r).sum(1) / r


def average_precision_scores(hits: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per-query (1/n) * sum_{i<=n} hits[i] * P@i (Q,) float64, for n > 0.

    ``n = R`` gives MAP@R's average precision, ``n = c`` Roth's mAP@C.
    """
    h = _within(hits, n)
    precision_at_i = np.cumsum(h, axis=1, dtype=np.float64) / np.arange(1, h.shape[1] + 1)
    return (precision_at_i * h).sum(1) / n


class RetrievalScores:
    """Per-query scores filled chunk by chunk, averaged by :meth:`result`.

    ``query_labels``, ``num_relevant`` (R) and ``window_c`` (mAP@C's c, DIML's R'): (Q,)
    arrays. :meth:`per_query` returns the per-query values behind every mean. ``names``:
    requested metrics among :data:`RETRIEVAL_METRICS`;
    ``recall_k``: the K values of ``recall_at_K``.
    """

    def __init__(
        self,
        query_labels: np.ndarray,
        num_relevant: np.ndarray,
        *,
        window_c: np.ndarray,
        names: Collection[str],
        recall_k: Sequence[int],
    ):
        self.labels = np.asarray(query_labels)
        self.r = np.asarray(num_relevant, np.int64)
        self.c = np.asarray(window_c, np.int64)
        self.valid = self.r > 0
        self.names = set(names)
        self.recall_k = tuple(int(k) for k in recall_k)
        q = len(self.labels)
        self.first_hit = np.zeros(q, np.int64)
        self.scores = {
            name: np.zeros(q, np.float64) for name in PER_QUERY_SCORES if name in self.names
        }

    def needed_k(self, *, recall: bool = True) -> int:
        """How many neighbours per query the requested metrics read; with ``recall=False`` all but
        Recall@K, whose larger K can be served by :meth:`set_first_hits` instead."""
        k = 1
        if recall and "recall_at_k" in self.names and self.recall_k:
            k = max(k, max(self.recall_k))
        if self.names & {"r_precision", "mean_average_precision_at_r"}:
            k = max(k, int(self.r.max(initial=0)))
        if self.names & set(_WINDOW_C):
            k = max(k, int(self.c.max(initial=0)))
        return k

    def rows_without_hit(self, listed_k: int) -> np.ndarray:
        """Scored queries with no relevant item in their ``listed_k`` neighbours, when a requested
        Recall@K looks further (their exact first-hit rank is then needed)."""
        if "recall_at_k" not in self.names or max(self.recall_k, default=0) <= listed_k:
            return np.empty(0, np.int64)
        return np.flatnonzero(self.valid & (self.first_hit == NO_HIT))

    def set_first_hits(self, rows: np.ndarray, ranks: np.ndarray) -> None:
        """Record exact 0-based first-hit ranks for ``rows`` (from outside the neighbour lists)."""
        self.first_hit[rows] = ranks

    def add(self, start: int, stop: int, neighbor_labels: np.ndarray) -> None:
        """Score queries ``start:stop`` from their neighbours' labels ((stop - start) x k)."""
        valid = self.valid[start:stop]
        rows = np.flatnonzero(valid) + start
        hits = neighbor_labels[valid] == self.labels[rows, None]
        r = self.r[rows]
        if (
            self.names & {"r_precision", "mean_average_precision_at_r"}
            and r.max(initial=0) > hits.shape[1]
        ):
            raise ValueError(f"need at least max R = {r.max()} neighbours, got {hits.shape[1]}")
        self.first_hit[rows] = first_hit_rank(hits)
        if "r_precision" in self.scores:
            self.scores["r_precision"][rows] = r_precision_scores(hits, r)
        if "mean_average_precision_at_r" in self.scores:
            self.scores["mean_average_precision_at_r"][rows] = average_precision_scores(hits, r)
        c = self.c[rows]
        if "map_at_c" in self.scores:
            self.scores["map_at_c"][rows] = average_precision_scores(hits, c)
        if "r_precision_query_in_r" in self.scores:
            self.scores["r_precision_query_in_r"][rows] = r_precision_scores(hits, c)
        if "mean_average_precision_at_r_query_in_r" in self.scores:
            self.scores["mean_average_precision_at_r_query_in_r"][rows] = average_precision_scores(
                hits, c
            )

    def result(self) -> dict[str, float]:
        """``num_queries``, ``num_lone_queries`` and the requested means (NaN when no query counts)."""
        valid = self.valid
        out: dict[str, float] = {
            "num_queries": int(valid.sum()),
            "num_lone_queries": int((~valid).sum()),
        }

        def mean(values: np.ndarray) -> float:
            return float(values[valid].mean()) if valid.any() else float("nan")

        if "precision_at_1" in self.names:
            out["precision_at_1"] = mean(self.first_hit == 0)
        if "recall_at_k" in self.names:
            for k in self.recall_k:
                out[f"recall_at_{k}"] = mean(self.first_hit < k)
        for name in PER_QUERY_SCORES:
            if name in self.scores:
                out[name] = mean(self.scores[name])
        return out

    def per_query(self) -> dict[str, np.ndarray]:
        """The values behind every mean, one entry per query (lone ones included, marked by
        ``num_relevant == 0`` and excluded from every mean): ``query_index``, ``label`` (the
        dense label code), ``num_relevant`` (R), ``first_hit_rank`` (0-based rank of the first
        relevant item; P@1 = rank 0, Recall@K = rank < K; ``NO_HIT`` when none was found) and
        each requested per-query score (``r_precision``, ``mean_average_precision_at_r``, ...)."""
        out = {
            "query_index": np.arange(len(self.labels), dtype=np.int64),
            "label": self.labels.astype(np.int64),
            "num_relevant": self.r.copy(),
            "first_hit_rank": np.where(self.valid, self.first_hit, NO_HIT),
        }
        out.update({name: values.copy() for name, values in self.scores.items()})
        return out


def retrieval_metrics(
    neighbor_labels: np.ndarray,
    query_labels: np.ndarray,
    num_relevant: np.ndarray,
    *,
    recall_k: Sequence[int] = (1,),
    metrics: Sequence[str] | None = None,
    same_source: bool = True,
) -> dict[str, float]:
    """All requested retrieval metrics from ranked lists (neighbor_labels: Q x k, self excluded).

    ``num_relevant``: R per query (:func:`relevant_counts`); ``same_source``
    decides mAP@C's window (c = R + 1 with a self, R without). The lists must
    hold at least max R items; Recall@K with K > k counts hits within the k only
    (``evaluate_embeddings`` ranks the first hit exactly instead).
    """
    r = np.asarray(num_relevant, np.int64)
    scores = RetrievalScores(
        query_labels,
        r,
        window_c=r + int(same_source),
        names=metrics or RETRIEVAL_METRICS,
        recall_k=recall_k,
    )
    scores.add(0, len(r), np.asarray(neighbor_labels))
    return scores.result()
