"""An estimate of a command's wall time on this device, made before its first run starts:
``run`` and ``sweep`` print it (:func:`estimate_runs`), and on a CPU refuse one of more
than an hour without ``--yes``.

A short warm-up (:class:`~harness.engine.run.warm_up.WarmUp`) measures a training step of
each distinct trained method on one real batch, the embedding of a batch of test images
by each distinct model with its method's own ranking, and the metrics on each split's
labels; the estimate scales them by the counts of the runs:

- training: epochs x batches per epoch (none for a run evaluated on another run's
  weights, such as DIML on ``plain``'s);
- embedding: the selection's evaluations (:meth:`~harness.config.sections.SelectionSpec.due`
  of each epoch: the validation split, or the test split under ``test-paper``) and the
  test split with its gallery, image by image;
- ranking by the method's scores: every (query, gallery) pair of an exhaustive ranking
  (AVSL's), or each query's top K re-ranked (DIML's), per evaluation;
- metrics: each evaluation's, twice for a method that ranks by its own scores (the
  cosine ranking's ``global_*`` metrics are computed too);
- the end of each run: the tracking store, the figures and, where models are logged, the
  exported embedder: :data:`RUN_SECONDS` and :data:`EXPORT_SECONDS` per run.

What it leaves out: data-loading stalls beyond the loader's measured batch, ``--compile``
(measured eagerly, without its compilation), a resume's finished epochs, and the time
before the estimate (imports, the dataset's checks, the warm-up itself).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.components.data import DatasetSplits
from harness.components.evaluation import RETRIEVAL_METRICS, with_paper_variants
from harness.config.protocol import Protocol
from harness.engine.run.run_config import RunConfig
from harness.engine.run.runtime import default_workers
from harness.engine.run.warm_up import EvaluationCost, WarmUp
from harness.methods import METHODS
from harness.store.environment import logs_model

__all__ = [
    "PlannedRun",
    "CostPart",
    "MethodCost",
    "Estimate",
    "estimate_runs",
    "duration",
    "RUN_SECONDS",
    "EXPORT_SECONDS",
]

#: Seconds of each run outside training, evaluation and the export: opening and closing its
#: tracked run, its figures (explanations, retrieval examples, the embedding map). Measured
#: on 2 CPU cores under the smoke protocol: 4.2-4.7 s a run for ``plain``, ``avsl`` and
#: ``diablo``, 10.1 s for ``sam``.
RUN_SECONDS = 5.0
#: Seconds of the exported embedder of a run whose model is logged (``torch.export`` and
#: the MLflow model): 5.1-13.8 s a run on 2 CPU cores under the smoke protocol.
EXPORT_SECONDS = 9.0


@dataclass(frozen=True)
class PlannedRun:
    """A run a command is about to start: its configuration and its splits."""

    cfg: RunConfig
    splits: DatasetSplits


@dataclass(frozen=True)
class CostPart:
    """One kind of work (``training``, ``embedding``, ``ranking``, ``metrics``, ``tracking
    and figures``) of a method's runs: what it is, for a person, and its estimated seconds."""

    kind: str
    what: str
    seconds: float


@dataclass(frozen=True)
class MethodCost:
    """A method's runs in an estimate: how many, how many train, their parts, and how a
    deviation would make its ranking cheaper by ranking a top K only (a ``--set``; "" for a
    method that ranks by the cosine)."""

    method: str
    runs: int
    trained: int
    parts: tuple[CostPart, ...]
    top_k_setting: str = ""

    @property
    def seconds(self) -> float:
        return sum(part.seconds for part in self.parts)


@dataclass(frozen=True)
class Estimate:
    """A command's estimated wall time on ``device``, per method, from a warm-up of
    ``warm_up_seconds``; counted from the moment it is printed to the command's end."""

    device: str
    methods: tuple[MethodCost, ...]
    warm_up_seconds: float
    #: The runs of the command whose warm-up worked; more than :attr:`runs` where the
    #: estimate stopped early, once the runs counted had passed its limit (then its
    #: seconds are a lower bound).
    planned: int = 0
    #: Methods whose warm-up failed, and how (their runs are not counted: each reports its
    #: own error when it runs).
    unmeasured: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        return sum(m.seconds for m in self.methods)

    @property
    def runs(self) -> int:
        """The runs counted."""
        return sum(m.runs for m in self.methods)

    @property
    def complete(self) -> bool:
        return self.runs >= self.planned

    def costliest(self) -> tuple[MethodCost, CostPart]:
        """The method and the part of its work that costs the most."""
        return max(
            ((m, p) for m in self.methods for p in m.parts),
            key=lambda mp: mp[1].seconds,
        )

    def line(self) -> str:
        """One line: the total, the runs, the kinds of work, the warm-up."""
        kinds: dict[str, float] = defaultdict(float)
        for m in self.methods:
            for part in m.parts:
                kinds[part.kind] += part.seconds
        shown = ", ".join(f"{kind} {duration(s)}" for kind, s in kinds.items() if s >= 0.5)
        missing = f"; not counted: {', '.join(self.unmeasured)}" if self.unmeasured else ""
        return (
            f"estimate: {self.amount()} on {self.device} for {self.counted()} "
            f"({shown}; measured in a {self.warm_up_seconds:.1f} s warm-up{missing})"
        )

    def amount(self) -> str:
        """``about 7 min 20 s``, or ``at least 38 h`` where the estimate stopped early."""
        return f"{'about' if self.complete else 'at least'} {duration(self.seconds)}"

    def counted(self) -> str:
        """``11 runs``, or ``11 runs (the first 2 counted)`` where it stopped early."""
        planned = max(self.planned, self.runs)
        text = f"{planned} run{'s' if planned != 1 else ''}"
        return text if self.complete else f"{text} (the first {self.runs} counted)"

    def breakdown(self) -> str:
        """One line: each method's share, the costliest first."""
        shares = []
        for m in sorted(self.methods, key=lambda m: -m.seconds):
            runs = f" x{m.runs}" if m.runs > 1 else ""
            trained = "" if m.trained else ", trains nothing"
            shares.append(f"{m.method}{runs} {duration(m.seconds)}{trained}")
        return "  per method: " + "; ".join(shares)


def duration(seconds: float) -> str:
    """``45 s``, ``7 min 20 s``, ``3 h 10 min``, ``38 h``, ``4.5 days``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    hours = seconds / 3600
    if hours < 10:
        return f"{int(hours)} h {int(seconds % 3600 // 60)} min"
    return f"{hours:.0f} h" if hours < 72 else f"{hours / 24:.1f} days"


def estimate_runs(
    runs: Sequence[PlannedRun],
    device: torch.device,
    *,
    workers: int | None = None,
    stop_over: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Estimate:
    """The estimated wall time of ``runs`` on ``device`` (their data loaded by ``workers``
    processes, default :func:`~harness.engine.run.runtime.default_workers`), in the order
    they run, from a warm-up timed by ``clock``. ``stop_over``: stop measuring once the
    runs counted pass these seconds (a lower bound is all a refusal needs)."""
    started = clock()
    if device.type == "cpu":  # as a run sets it (denormal floats slow CPU kernels many-fold)
        torch.set_flush_denormal(True)
    warm_up = WarmUp(device, default_workers(device) if workers is None else workers, clock)
    parts: dict[str, list[CostPart]] = defaultdict(list)
    runs_of: dict[str, int] = defaultdict(int)
    trained: dict[str, int] = defaultdict(int)
    hints: dict[str, str] = {}
    total, unmeasured = 0.0, dict[str, str]()
    for run in runs:
        cfg = run.cfg
        if cfg.method in unmeasured:
            continue
        try:
            found = _run_parts(warm_up, run)
        except Exception as err:  # the run itself reports it, in its own way
            unmeasured.setdefault(cfg.method, f"{cfg.method} (its warm-up: {type(err).__name__})")
            continue
        parts[cfg.method] += found
        runs_of[cfg.method] += 1
        trained[cfg.method] += int(not cfg.evaluate_only and cfg.protocol.schedule.epochs > 0)
        hints[cfg.method] = _top_k_setting(cfg)
        total += sum(part.seconds for part in found)
        if stop_over is not None and total > stop_over:
            break
    methods = tuple(
        MethodCost(method, runs_of[method], trained[method], _merged(found), hints[method])
        for method, found in parts.items()
    )
    failed = sum(run.cfg.method in unmeasured for run in runs)
    planned = len(runs) - failed
    return Estimate(device.type, methods, clock() - started, planned, tuple(unmeasured.values()))


def _run_parts(warm_up: WarmUp, run: PlannedRun) -> list[CostPart]:
    """The parts of one run's work, measured (once per setting) and counted."""
    cfg, splits = run.cfg, run.splits
    protocol, method = cfg.protocol, cfg.method
    epochs = 0 if cfg.evaluate_only else protocol.schedule.epochs
    train_key = (method, repr(cfg.method_options), cfg.loss, repr(cfg.loss_args), len(splits.train))
    train_key += _cost_key(protocol, cfg.dataset)
    parts, build = [], 0.0
    if epochs:
        step = warm_up.training(train_key, cfg, splits)
        batches = epochs * step.batches
        what = f"{method}'s training of {epochs:,} epochs x {step.batches:,} batches"
        parts.append(CostPart("training", what, batches * step.seconds))
        build = step.build
    eval_key = (method, repr(cfg.method_options), _cost_key(protocol, cfg.dataset))
    cost = warm_up.evaluation(eval_key, cfg, splits, train_key if epochs else None)
    parts += _evaluation_parts(warm_up, cfg, splits, cost, _selections(protocol, epochs))
    end = RUN_SECONDS + build + cost.build + (EXPORT_SECONDS if logs_model() else 0.0)
    parts.append(CostPart("tracking and figures", f"{method}'s tracked runs and figures", end))
    return parts


def _selections(protocol: Protocol, epochs: int) -> int:
    """How many times the selection evaluates during ``epochs`` epochs."""
    selection = protocol.selection
    if selection.mode not in ("validation", "test-paper"):
        return 0
    return sum(selection.due(epoch, epochs) for epoch in range(1, epochs + 1))


def _evaluation_parts(
    warm_up: WarmUp,
    cfg: RunConfig,
    splits: DatasetSplits,
    cost: EvaluationCost,
    selections: int,
) -> list[CostPart]:
    """Embedding, ranking and metrics of the selection's evaluations and of the test."""
    protocol, method = cfg.protocol, cfg.method
    test = _Searched.of(splits.test, splits.gallery)
    on_test = protocol.selection.mode == "test-paper" or splits.val is None
    val = test if on_test else _Searched.of(splits.val, None)
    chosen = [
        m for m in protocol.evaluation.metrics if m in RETRIEVAL_METRICS or m == "recall_at_k"
    ]
    chosen = list(dict.fromkeys([*chosen, protocol.selection.metric]))
    every = with_paper_variants(protocol.evaluation.metrics)
    metric_seconds = _metrics(warm_up, cfg, test, cost.dim, every, True)
    if selections:
        metric_seconds += selections * _metrics(warm_up, cfg, val, cost.dim, tuple(chosen), False)
    images = selections * val.images + test.images
    evaluations = (
        f"{selections:,} selection{'s' if selections != 1 else ''} and the test"
        if selections
        else "the test"
    )
    times = 2 if cost.ranking else 1  # the method's ranking, then the cosine's (global_*)
    return [
        CostPart(
            "embedding",
            f"{method}'s embedding of {images:,} images for {evaluations}",
            images * cost.image_seconds,
        ),
        *_ranking_parts(method, cost, val, test, selections),
        CostPart("metrics", f"{method}'s metrics of {evaluations}", times * metric_seconds),
    ]


@dataclass(frozen=True)
class _Searched:
    """An evaluated split's labels: its queries' and its gallery's (None: the queries
    search each other)."""

    labels: Any
    gallery_labels: Any

    @classmethod
    def of(cls, queries, gallery) -> _Searched:
        return cls(queries.labels, None if gallery is None else gallery.labels)

    @property
    def queries(self) -> int:
        return len(self.labels)

    @property
    def searched(self) -> int:
        """Items each query is ranked against (itself included where it searches its own
        split, as the exhaustive ranking scores it)."""
        return self.queries if self.gallery_labels is None else len(self.gallery_labels)

    @property
    def images(self) -> int:
        return self.queries + (0 if self.gallery_labels is None else len(self.gallery_labels))


def _metrics(
    warm_up: WarmUp, cfg: RunConfig, split: _Searched, dim: int, metrics, per_query: bool
) -> float:
    """Seconds of one evaluation's metrics of ``split`` (measured once per split and
    metrics)."""
    metrics = tuple(metrics)
    key = (cfg.dataset, split.queries, split.searched, metrics, per_query, dim)
    return warm_up.metrics(
        key,
        split.labels,
        split.gallery_labels,
        dim,
        recall_k=cfg.protocol.evaluation.recall_k_for(cfg.dataset),
        metrics=metrics,
        per_query=per_query,
    )


def _ranking_parts(
    method: str, cost: EvaluationCost, val: _Searched, test: _Searched, selections: int
) -> list[CostPart]:
    """The method's own ranking of the selection's splits and of the test split."""
    if not cost.ranking:
        return []
    if cost.ranking == "exhaustive":
        pairs = test.queries * test.searched + selections * val.queries * val.searched
        what = f"{method}'s exhaustive ranking of {test.queries:,} x {test.searched:,} test pairs"
        if selections:
            what += f" and {selections:,} x {val.queries:,} x {val.searched:,} for the selection"
        return [CostPart("ranking", what, pairs * cost.pair_seconds)]
    ranked = test.queries + selections * val.queries
    what = f"{method}'s top-{cost.rerank_k} re-ranking of {test.queries:,} test queries"
    if selections:
        what += f" and {selections:,} x {val.queries:,} for the selection"
    return [CostPart("ranking", what, ranked * cost.query_seconds)]


def _merged(parts: list[CostPart]) -> tuple[CostPart, ...]:
    """One part per kind: the seconds summed, described as its costliest run's."""
    merged: dict[str, CostPart] = {}
    for part in sorted(parts, key=lambda p: -p.seconds):
        if part.kind in merged:
            first = merged[part.kind]
            merged[part.kind] = CostPart(part.kind, first.what, first.seconds + part.seconds)
        else:
            merged[part.kind] = part
    return tuple(merged.values())


def _cost_key(protocol: Protocol, dataset: str) -> tuple:
    """What decides a run's cost per step and per image, beside its method: the dataset and
    the protocol's backbone, images, embedding, batches, miner, precision and evaluation."""
    return (
        dataset,
        repr(protocol.backbone),
        repr(protocol.image),
        repr(protocol.embedding),
        repr(protocol.sampling),
        repr(protocol.miner),
        repr(protocol.numerics),
        repr(protocol.training),
        repr(protocol.evaluation),
    )


def _top_k_setting(cfg: RunConfig) -> str:
    """How ``cfg``'s method could rank only each query's top K cosine candidates where it
    ranks every pair (a method option ``rank`` beside ``rerank_k``), or fewer of them where
    it re-ranks a top K (``rerank_k``): a ``--set``, a deviation; "" for neither."""
    options = {**METHODS.get(cfg.method).options(), **cfg.method_options}
    if options.get("rank") == "exhaustive" and "rerank_k" in options:
        return (
            f"declare a top-K re-ranking deviation with --set methods.{cfg.method}.rank=rerank "
            f"(its top {options['rerank_k']} cosine candidates re-scored)"
        )
    if options.get("rerank_k"):
        return (
            f"re-rank fewer candidates with --set methods.{cfg.method}.rerank_k=K "
            f"(a deviation; the protocol's K is {options['rerank_k']})"
        )
    return ""
