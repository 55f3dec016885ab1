"""The warm-up behind :func:`~harness.engine.run.estimate.estimate_runs`: a few measured
pieces of a command's work on this device, each measured once per distinct setting.

- :meth:`WarmUp.training`: a run's trainer as
  :meth:`~harness.engine.run.trainer.Trainer.from_config` builds it (eagerly: ``--compile``
  is not measured; on the CPU with batches of at most about :data:`CPU_STEP_IMAGES`
  images, the time scaled to the run's batch), the loading of a batch of its training
  loader, and steps on one until :data:`STEP_SECONDS` have passed (at most
  :data:`MAX_TIMED_STEPS`), their median taken; the warm-up's first step on the CPU, which
  pays for setting up threads and memory, and each model's first on a GPU are not counted.
- :meth:`WarmUp.evaluation`: :func:`~harness.engine.run.embedding.embed_images` over a
  batch of test images (the loading timed apart), and where the head ranks by its own
  scores (:func:`~harness.engine.run.embedding.head_ranking`) one call of its pair scorer
  or re-ranker on the fields kept (:func:`~harness.engine.run.embedding.make_pair_scorer`,
  :func:`~harness.engine.run.embedding.make_reranker`), in the shape the evaluation calls it.
- :meth:`WarmUp.metrics`: :func:`~harness.components.evaluation.evaluate_embeddings` on
  random class-clustered embeddings with a split's own labels; a split of more than
  :data:`PROBE_QUERIES` queries is probed on whole classes at two sizes and the time
  extrapolated by ``a n + b n^2`` through both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from harness.components.data import DatasetSplits
from harness.components.data.sampling import TransformedImages
from harness.components.data.transforms import build_transform
from harness.components.evaluation import evaluate_embeddings
from harness.engine.run.data import TrainingBatches, adapted_sampling
from harness.engine.run.embedding import (
    CPU_FORWARD_BATCH,
    embed_images,
    head_ranking,
    make_pair_scorer,
    make_reranker,
    pair_chunks,
)
from harness.engine.run.model import EmbeddingModel, build_model, on_device
from harness.engine.run.recorder import NullRecorder
from harness.engine.run.run_config import RunConfig
from harness.engine.run.trainer import Trainer

__all__ = [
    "WarmUp",
    "StepCost",
    "EvaluationCost",
    "MAX_TIMED_STEPS",
    "STEP_SECONDS",
    "CPU_STEP_IMAGES",
    "CPU_EMBED_IMAGES",
    "PROBE_QUERIES",
]

#: Timed training steps on the warm-up's batch: as many as fill :data:`STEP_SECONDS` (at
#: least one, at most this many); their median is the step's time.
MAX_TIMED_STEPS = 5
STEP_SECONDS = 0.5
#: Images per warm-up step on the CPU, where a run's batch is larger: the step's time is
#: scaled by the run's batch over this one's (the backbone's cost grows with the images).
CPU_STEP_IMAGES = CPU_FORWARD_BATCH
#: Classes of a smaller warm-up batch at least (the methods that draw tuples need several).
MIN_CLASSES = 4
#: Test images embedded by the warm-up on the CPU.
CPU_EMBED_IMAGES = 16
#: The most queries a metrics probe scores at once.
PROBE_QUERIES = 4096
#: Queries of a timed re-ranking call on the CPU and on a GPU.
CPU_RERANK_QUERIES, CUDA_RERANK_QUERIES = 32, 256


@dataclass(frozen=True)
class StepCost:
    """A run's measured training: seconds per batch (its step, or its loading where that is
    slower), batches per epoch, and the seconds to build the trainer."""

    seconds: float
    batches: int
    build: float


@dataclass(frozen=True)
class EvaluationCost:
    """A model's measured evaluation: seconds per embedded image; how its head ranks
    (``"exhaustive"``, ``"rerank"`` or ``""`` for the cosine alone) with the candidates
    per query it re-scores, the seconds per scored pair or per re-ranked query; the
    embedding's width; the seconds to build the model (0 where a trainer's was used)."""

    image_seconds: float
    ranking: str
    rerank_k: int
    pair_seconds: float
    query_seconds: float
    dim: int
    build: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WarmUp:
    """The measurements of one estimate, on ``device``, for runs loading with ``workers``
    processes; ``clock`` (default ``time.perf_counter``) times them. Each is made once per
    key and kept."""

    def __init__(
        self,
        device: torch.device,
        workers: int,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.device, self.workers, self.clock = device, workers, clock
        self.steps: dict[Any, StepCost] = {}
        self.evaluations: dict[Any, EvaluationCost] = {}
        self.metric_costs: dict[Any, float] = {}
        #: The model the last measured training trained, under its key, until evaluated.
        self.trained: tuple[Any, EmbeddingModel] | None = None
        #: Whether a training step has run in this process (the first is slower).
        self.warm = False

    def per_batch(self, compute: float, loading: float) -> float:
        """Seconds a batch takes: loading after computing without loader processes, the
        slower of the two with them (the loader works ahead)."""
        if self.workers == 0:
            return compute + loading
        return max(compute, loading / self.workers)

    def training(self, key: Any, cfg: RunConfig, splits: DatasetSplits) -> StepCost:
        """The step of ``cfg``'s run on ``splits`` (its model kept, under ``key``, for the
        :meth:`evaluation` that follows)."""
        if key in self.steps:
            return self.steps[key]
        started = self.clock()
        trainer = Trainer.from_config(
            self._warm_up_config(cfg), splits, recorder=NullRecorder(), device=self.device
        )
        build = self.clock() - started
        trainer.batches.sampler.set_epoch(0)
        loading, (images, labels) = self._loading(trainer)
        images, labels = images.to(self.device), labels.to(self.device)
        trainer.model.train()
        step = self._step_seconds(trainer, images, labels)
        self.trained = (key, trainer.model)
        scale, batches = 1.0, len(trainer.batches.sampler)
        if trainer.protocol.sampling != cfg.protocol.sampling:  # a smaller batch than the run's
            classes, per_class, _ = adapted_sampling(cfg.protocol, splits.train.num_classes)
            scale = classes * per_class / max(len(images), 1)
            run = TrainingBatches.build(
                cfg.protocol, splits, seed=cfg.seed, device=self.device, loss_name=cfg.loss
            )
            batches = len(run.sampler)
        cost = StepCost(self.per_batch(step * scale, loading * scale), batches, build)
        self.steps[key] = cost
        return cost

    def _loading(self, trainer: Trainer) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
        """Seconds to load a training batch (the second of the epoch where there is one:
        the first pays for setting up the epoch), and the first batch's images and labels."""
        batches = iter(trainer.batches.loader)
        started = self.clock()
        images, labels, _ = next(batches)
        loading = self.clock() - started
        if len(trainer.batches.sampler) > 1:
            started = self.clock()
            next(batches)
            loading = self.clock() - started
        return loading, (images, labels)

    def _warm_up_config(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` trained eagerly (``--compile`` is not measured), and on the CPU in
        batches of about :data:`CPU_STEP_IMAGES` images where the run's are larger."""
        eager = replace(cfg, settings=replace(cfg.settings, compile=False, cuda_graphs=False))
        sampling = cfg.protocol.sampling
        if self.device.type != "cpu" or sampling.batch_size <= CPU_STEP_IMAGES:
            return eager
        classes = max(MIN_CLASSES, CPU_STEP_IMAGES // sampling.samples_per_class)
        smaller = replace(sampling, classes_per_batch=min(classes, sampling.classes_per_batch))
        return replace(eager, protocol=replace(cfg.protocol, sampling=smaller))

    def _step_seconds(self, trainer: Trainer, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Seconds of a training step on one batch: the median of the steps that fill
        :data:`STEP_SECONDS` (at most :data:`MAX_TIMED_STEPS`). The first step of the
        warm-up on the CPU is not counted: it pays for the threads' and the allocator's
        set-up (measured on 2 CPU cores, smoke protocol: 0.83 s against 0.55 s; a later
        method's first step is within 10% of its next). On a GPU no model's first step is
        counted (it chooses its kernels). A non-finite loss ends the steps."""
        skip, timed = self.device.type == "cuda" or not self.warm, []
        self.warm = True
        for index in range(1 + MAX_TIMED_STEPS):
            started = self.clock()
            loss, _ = trainer.train_step(images, labels, 0, index)
            finite = math.isfinite(float(loss))  # waits for the device
            elapsed = self.clock() - started
            if skip and finite:
                skip = False
                continue
            timed.append(elapsed)
            # Weights a non-finite loss has reached can fail the next step: the run reports it.
            if not finite or sum(timed) >= STEP_SECONDS or len(timed) == MAX_TIMED_STEPS:
                break
        return float(np.median(timed))

    def evaluation(
        self, key: Any, cfg: RunConfig, splits: DatasetSplits, model_key: Any = None
    ) -> EvaluationCost:
        """The evaluation of ``cfg``'s model (the one :meth:`training` trained last when
        that was under ``model_key``, else one built here) on a batch of ``splits.test``."""
        if key in self.evaluations:
            return self.evaluations[key]
        started = self.clock()
        trained, self.trained = self.trained, None  # a trained model is used once, then let go
        model = trained[1] if trained is not None and trained[0] == model_key else None
        build = 0.0
        if model is None:
            model = on_device(
                build_model(cfg.protocol, cfg.method, cfg.method_options), self.device
            )
            build = self.clock() - started
        exhaustive, rerank_k, keep = head_ranking(model.head)
        image_seconds, fields, dim = self._embedding(cfg, splits, model, keep)
        pair = self._pair_seconds(model, fields) if exhaustive else 0.0
        query = self._rerank_seconds(model, fields, rerank_k) if rerank_k else 0.0
        ranking = "exhaustive" if exhaustive else "rerank" if rerank_k else ""
        cost = EvaluationCost(image_seconds, ranking, rerank_k, pair, query, dim, build)
        self.evaluations[key] = cost
        return cost

    def _embedding(
        self, cfg: RunConfig, splits: DatasetSplits, model: EmbeddingModel, keep: tuple
    ) -> tuple[float, dict[str, torch.Tensor], int]:
        """Seconds per test image embedded, the fields kept of a batch, the width."""
        protocol, cpu = cfg.protocol, self.device.type == "cpu"
        count = min(len(splits.test), CPU_EMBED_IMAGES if cpu else protocol.evaluation.batch_size)
        images = splits.test.subset(np.arange(count))
        transform = build_transform(protocol.image, train=False)
        started = self.clock()
        loaded = TransformedImages(images, transform)
        for index in range(count):
            loaded[index]
        loading = self.clock() - started
        embedded = np.zeros((0, 0), np.float32)
        fields: dict[str, torch.Tensor] = {}
        for _ in range(1 if cpu else 2):  # on a GPU the first pass chooses its kernels
            started = self.clock()
            embedded, fields = embed_images(
                model,
                images,
                transform,
                protocol.image,
                batch_size=count,
                device=self.device,
                keep=keep,
                precision=protocol.numerics.precision,
            )
            elapsed = self.clock() - started
        per_image = self.per_batch(max(elapsed - loading, 0.0), loading) / max(count, 1)
        return per_image, fields, int(embedded.shape[1])

    def _pair_seconds(self, model: EmbeddingModel, fields: dict[str, torch.Tensor]) -> float:
        """Seconds per (query, gallery) pair of the head's pair scores, in the evaluation's
        chunk of queries and gallery items (the fields of the batch repeated to fill it)."""
        queries, gallery = pair_chunks(PROBE_QUERIES)
        index = torch.arange(max(queries, gallery)) % len(next(iter(fields.values())))
        scorer = make_pair_scorer(
            model.head,  # type: ignore[arg-type]
            {k: v[index] for k, v in fields.items()},
            device=self.device,
        )
        scorer(np.arange(1), np.arange(gallery))  # the first call sets up
        _sync(self.device)
        started = self.clock()
        scorer(np.arange(queries), np.arange(gallery)).sum().item()
        return (self.clock() - started) / (queries * gallery)

    def _rerank_seconds(
        self, model: EmbeddingModel, fields: dict[str, torch.Tensor], rerank_k: int
    ) -> float:
        """Seconds per query of the head's re-ranking of ``rerank_k`` candidates (drawn from
        the batch)."""
        queries = CPU_RERANK_QUERIES if self.device.type == "cpu" else CUDA_RERANK_QUERIES
        items = len(next(iter(fields.values())))
        rerank = make_reranker(model.head, fields, device=self.device)  # type: ignore[arg-type]
        candidates = np.random.default_rng(0).integers(0, items, (queries, rerank_k))
        rerank(np.zeros(1, np.int64), candidates[:1])  # the first call sets up
        started = self.clock()
        rerank(np.arange(queries) % items, candidates)
        return (self.clock() - started) / queries

    def metrics(
        self,
        key: Any,
        labels: np.ndarray,
        gallery_labels: np.ndarray | None,
        dim: int,
        **evaluate: Any,
    ) -> float:
        """Seconds of :func:`~harness.components.evaluation.evaluate_embeddings` (its
        keyword arguments ``evaluate``) on queries of ``labels`` searched against each other
        or against a gallery of ``gallery_labels``, ``dim`` wide."""
        if key in self.metric_costs:
            return self.metric_costs[key]
        if len(labels) <= PROBE_QUERIES:
            seconds = self._time_metrics(labels, gallery_labels, dim, evaluate)
        else:
            sizes, times = [], []
            for size in (PROBE_QUERIES // 2, PROBE_QUERIES):
                queries, gallery = _whole_classes(labels, gallery_labels, size)
                sizes.append(len(queries))
                times.append(self._time_metrics(queries, gallery, dim, evaluate))
            seconds = _extrapolated(sizes, times, len(labels))
        self.metric_costs[key] = seconds
        return seconds

    def _time_metrics(
        self, labels: np.ndarray, gallery_labels: np.ndarray | None, dim: int, evaluate: dict
    ) -> float:
        rng = np.random.default_rng(0)
        codes = np.unique(
            np.concatenate([labels, [] if gallery_labels is None else gallery_labels]),
            return_inverse=True,
        )[1]
        centres = rng.standard_normal((int(codes.max()) + 1, dim)).astype(np.float32)
        points = centres[codes] + rng.standard_normal((len(codes), dim)).astype(np.float32)
        queries, gallery = points[: len(labels)], points[len(labels) :]
        started = self.clock()
        evaluate_embeddings(
            queries,
            labels,
            None if gallery_labels is None else gallery,
            gallery_labels,
            use_gpu=self.device.type == "cuda",
            **evaluate,
        )
        return self.clock() - started


def _whole_classes(
    labels: np.ndarray, gallery_labels: np.ndarray | None, size: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """The labels of whole classes drawn at random (seeded) until about ``size`` queries,
    and their gallery's: a smaller split of the same images per class."""
    classes, counts = np.unique(labels, return_counts=True)
    order = np.random.default_rng(0).permutation(len(classes))
    kept = classes[order[: int(np.searchsorted(np.cumsum(counts[order]), size)) + 1]]
    queries = labels[np.isin(labels, kept)]
    gallery = None if gallery_labels is None else gallery_labels[np.isin(gallery_labels, kept)]
    return queries, gallery


def _extrapolated(sizes: list[int], times: list[float], size: int) -> float:
    """``a n + b n^2`` at ``size`` through the two measured points (a and b at least 0:
    where one comes out negative, the other term alone through the larger point)."""
    (n1, n2), (t1, t2) = sizes, times
    b = (t2 / n2 - t1 / n1) / (n2 - n1) if n2 != n1 else 0.0
    a = t1 / n1 - b * n1
    if b < 0:
        a, b = t2 / n2, 0.0
    elif a < 0:
        a, b = 0.0, t2 / n2**2
    return a * size + b * size**2 if math.isfinite(a + b) else t2 * size / n2
