"""Evaluation of a model: embed image sets, score them, re-rank where the method scores pairs.

The engine knows one thing about methods that score their own way: a method may
score (query, candidate) pairs from fields it keeps per image (``rerank_fields``,
``rerank_k`` of the :class:`~harness.methods.roles.Reranker` role, scored by
:func:`~harness.methods.roles.rerank_scores`). :func:`make_reranker` is the one adapter from
that role to the id-based :data:`~harness.components.evaluation.Reranker` that
:func:`~harness.components.evaluation.evaluate_embeddings` calls. A
:class:`~harness.methods.roles.PairScorer` that declares ``exhaustive_pairs`` is ranked by
its pair scores over the whole gallery instead (``score_pairs`` through
:func:`make_pair_scorer`, chunked).
"""

from __future__ import annotations

import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from harness.base.device import amp_dtype
from harness.base.errors import HarnessError
from harness.components.data import DatasetSplits
from harness.components.data.sampling import TransformedImages
from harness.components.data.transforms import build_transform, normalize_batch
from harness.components.evaluation import Reranker, Scores, evaluate_embeddings
from harness.methods import roles

if TYPE_CHECKING:
    # The benchmark's protocol, named apart from typing.Protocol (the Evaluator interface).
    from harness.config.protocol import Protocol as BenchmarkProtocol
    from harness.engine.run.model import EmbeddingModel

__all__ = [
    "Evaluator",
    "SplitEvaluator",
    "EmbeddedScores",
    "loader_worker_init",
    "embed_images",
    "evaluate_split",
    "head_ranking",
    "make_reranker",
    "make_pair_scorer",
    "pair_chunks",
    "CPU_FORWARD_BATCH",
    "QUERIES_PER_RERANK_CALL",
    "QUERIES_PER_RERANK_CALL_CUDA",
    "PAIRS_PER_CALL",
]

#: Queries whose candidates are gathered per ``rerank_by_ids`` call (bounds the memory of
#: the gathered fields: queries x K x field size).
QUERIES_PER_RERANK_CALL = 256
#: The same on a GPU, where one call should hold enough pairs to fill the device.
QUERIES_PER_RERANK_CALL_CUDA = 4096
#: (query, gallery) pairs per ``score_pairs`` call of the exhaustive ranking (a method's memory
#: is about this many pairs x its field size, e.g. 16,384 x 512 floats = 32 MiB per tensor).
PAIRS_PER_CALL = 1 << 14


def make_reranker(
    method: roles.Reranker,
    query_fields: Mapping[str, torch.Tensor],
    gallery_fields: Mapping[str, torch.Tensor] | None = None,
    *,
    queries_per_call: int | None = None,
    device: torch.device | str | None = None,
) -> Reranker:
    """``(query ids (Q,), candidate ids Q x K) -> Q x K float32 scores`` from the method's
    re-ranking scores (:func:`~harness.methods.roles.rerank_scores`) over stored fields
    (``gallery_fields=None``: same-source retrieval), ``queries_per_call`` queries at a time
    (default: 256 on the CPU, 4,096 on a GPU).
    ``device``: where the fields are moved once and the scores computed (default: where
    they are)."""
    same = gallery_fields is None
    gallery_fields = query_fields if gallery_fields is None else gallery_fields
    missing = [f for f in method.rerank_fields if f not in query_fields or f not in gallery_fields]
    if missing:
        raise HarnessError(f"re-ranking with {type(method).__name__} needs the fields {missing}")
    if device is not None:
        query_fields = {k: query_fields[k].to(device) for k in method.rerank_fields}
        gallery_fields = (
            query_fields
            if same
            else {k: gallery_fields[k].to(device) for k in method.rerank_fields}
        )
    on_cuda = next(iter(query_fields.values())).device.type == "cuda" if query_fields else False
    queries_per_call = queries_per_call or (
        QUERIES_PER_RERANK_CALL_CUDA if on_cuda else QUERIES_PER_RERANK_CALL
    )

    @torch.inference_mode()
    def rerank(query_ids: np.ndarray, candidate_ids: np.ndarray) -> np.ndarray:
        query_ids, candidate_ids = np.asarray(query_ids), np.asarray(candidate_ids)
        out = [
            roles.rerank_scores(
                method,
                query_fields,
                gallery_fields,
                query_ids[i : i + queries_per_call],
                candidate_ids[i : i + queries_per_call],
            )
            .float()
            .cpu()
            for i in range(0, len(query_ids), queries_per_call)
        ]
        return torch.cat(out).numpy() if out else np.zeros(candidate_ids.shape, np.float32)

    return rerank


def pair_chunks(
    num_gallery: int, *, pairs: int = PAIRS_PER_CALL, queries: int = 64
) -> tuple[int, int]:
    """(queries, gallery items) per ``score_pairs`` call: about ``pairs`` pairs per call."""
    queries = max(1, min(queries, pairs))
    return queries, max(1, min(max(num_gallery, 1), pairs // queries))


def make_pair_scorer(
    method: roles.PairScorer,
    query_fields: Mapping[str, torch.Tensor],
    gallery_fields: Mapping[str, torch.Tensor] | None = None,
    *,
    device: torch.device | str = "cpu",
):
    """``(query ids (Q,), gallery ids (G,)) -> Q x G`` scores of every pair from the method's
    ``score_pairs`` over stored fields (moved to ``device`` once; ``gallery_fields=None``:
    same-source retrieval). Results stay on ``device``."""
    gallery_fields = query_fields if gallery_fields is None else gallery_fields
    missing = [f for f in method.rerank_fields if f not in query_fields or f not in gallery_fields]
    if missing:
        raise HarnessError(f"pair scoring with {type(method).__name__} needs the fields {missing}")
    device = torch.device(device)
    q_dev = {k: query_fields[k].to(device) for k in method.rerank_fields}
    g_dev = (
        q_dev
        if gallery_fields is query_fields
        else {k: gallery_fields[k].to(device) for k in method.rerank_fields}
    )

    @torch.inference_mode()
    def score(query_ids: np.ndarray, gallery_ids: np.ndarray) -> torch.Tensor:
        q = torch.as_tensor(np.asarray(query_ids), dtype=torch.long, device=device)
        g = np.asarray(gallery_ids)
        if (
            len(g) and g[-1] - g[0] + 1 == len(g) and (np.diff(g) == 1).all()
        ):  # a range: views, no gather
            gal = {k: v[int(g[0]) : int(g[-1]) + 1] for k, v in g_dev.items()}
        else:
            gi = torch.as_tensor(g, dtype=torch.long, device=device)
            gal = {k: v[gi] for k, v in g_dev.items()}
        return method.score_pairs({k: v[q] for k, v in q_dev.items()}, gal).float()

    return score


#: Images per forward pass on CPU, whatever the protocol's evaluation batch: in eval mode an
#: image's embedding does not depend on its batch, and on CPU time per image grows with the
#: batch once the activations leave the cache. Measured on 2 cores, smoke protocol, the 1,440
#: test images, two passes each: ``plain`` 4.6-6.6 s at batch 16-32 and 7.6-9.5 s at 128;
#: DIABLO (N = 2) 7.1-9.5 s and 10.3-11.9 s; the embeddings were bit-identical. GPUs use
#: the protocol's batch.
CPU_FORWARD_BATCH = 32


def loader_worker_init(worker_id: int) -> None:
    """Each DataLoader worker leaves the main process's process group: a SIGTERM sent to
    the whole group (a sweep stopping its workers, a cluster's time limit) reaches the
    main process alone, which marks the run KILLED and shuts the workers down, instead of
    the workers dying first and the main process reporting their deaths as an error. The
    workers still end with the main process (PyTorch's worker loop watches its parent), and
    a SIGTERM sent to a worker itself (multiprocessing's shutdown at exit) still ends it."""
    os.setpgid(0, 0)


@torch.inference_mode()
def embed_images(
    model: EmbeddingModel,
    images,
    transform,
    image_spec,
    *,
    batch_size: int,
    device: torch.device,
    workers: int = 0,
    keep: tuple[str, ...] = (),
    precision: str = "bf16",
) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """Embeddings (N x D float32) of an image set, plus the head-output fields in ``keep``
    (``batch_size`` images per forward pass, at most :data:`CPU_FORWARD_BATCH` on CPU),
    under the protocol's ``[numerics] precision`` (:func:`harness.base.device.amp_dtype`).
    At a terminal a progress bar shows the images embedded, their rate and the time left."""
    model.eval()
    if device.type == "cpu":
        batch_size = min(batch_size, CPU_FORWARD_BATCH)
    loader = DataLoader(
        TransformedImages(images, transform),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=loader_worker_init,
    )
    kept: dict[str, list[torch.Tensor]]
    embs, kept = [], {k: [] for k in keep}
    dtype = amp_dtype(device, precision)
    with _bar(len(images), "embedding", "img") as bar:
        for batch, _, _ in loader:
            count = len(batch)
            batch = normalize_batch(batch.to(device, non_blocking=True), image_spec)
            batch = batch.contiguous(memory_format=torch.channels_last)  # as in training
            with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
                out = model(batch)
            # Kept on the device until the end: a copy to the host per batch would wait for
            # the batch's forward pass before the next one is queued.
            embs.append(out.embedding.float())
            for k in keep:
                kept[k].append(out.field(k).float())
            bar.update(count)
    emb = (
        torch.cat(embs).cpu().numpy()
        if embs
        else np.zeros((0, model.head.embedding_size), np.float32)
    )
    return emb, {k: torch.cat(v).cpu() for k, v in kept.items()}


class EmbeddedScores(Scores):
    """:class:`~harness.components.evaluation.Scores` with the embeddings they were computed
    from: ``embeddings`` is ``(queries, gallery)`` (Q x D and N x D float32; the gallery
    None where the queries search each other), so that what follows a test (the run's
    figures) needs no second pass over its images."""

    embeddings: tuple[np.ndarray, np.ndarray | None] | None = None


def evaluate_split(
    model: EmbeddingModel,
    query_set,
    gallery_set,
    protocol: BenchmarkProtocol,
    dataset: str,
    *,
    device: torch.device,
    workers: int = 0,
    rerank: bool = True,
    metrics: tuple[str, ...] | None = None,
    per_query: bool = False,
) -> Scores:
    """Metrics of ``query_set`` searched against ``gallery_set`` (or against itself when None).

    A head that re-ranks (``rerank_fields`` and a positive ``rerank_k``) re-scores each
    query's top ``rerank_k`` candidates; one that declares ``exhaustive_pairs`` ranks every
    query against the whole gallery by its pair scores (chunked, on ``device``). The plain
    cosine ranking's metrics are then returned too, prefixed ``global_``, with
    ``num_ranked_candidates``: how many candidates per query the method scored.
    ``per_query``: keep the per-query values of the method's ranking (``result.per_query``).
    The embeddings scored ride along (:class:`EmbeddedScores`).
    """
    head = model.head
    exhaustive, rerank_k, keep = head_ranking(head) if rerank else (False, 0, ())
    q, q_fields, g, g_fields = _embed_sets(
        model, query_set, gallery_set, protocol, device=device, workers=workers, keep=keep
    )
    g_labels = None if gallery_set is None else gallery_set.labels

    def score(**kw) -> Scores:
        return evaluate_embeddings(
            q,
            query_set.labels,
            g,
            g_labels,
            recall_k=protocol.evaluation.recall_k_for(dataset),
            metrics=metrics or protocol.evaluation.metrics,
            use_gpu=device.type == "cuda",
            **kw,
        )

    if not exhaustive and rerank_k == 0:
        return _embedded(score(per_query=per_query), q, g)
    fields = (q_fields, None if gallery_set is None else g_fields)
    searched = len(q) if g is None else len(g)
    ranked = _method_ranking(head, score, fields, len(q), searched, rerank_k, device, per_query)
    return _embedded(_with_global(ranked, score()), q, g)


def _method_ranking(
    head, score, fields, queries: int, searched: int, rerank_k: int, device, per_query: bool
) -> Scores:
    """The metrics of ``head``'s own ranking of ``queries`` queries, each against
    ``searched`` items (``score``: the evaluation with the ranking's arguments): every pair
    by its pair scores (``rerank_k`` 0), else the top ``rerank_k`` re-ranked; from the kept
    ``fields`` (the queries', the gallery's or None), with a progress bar."""
    if rerank_k == 0:
        same = fields[1] is None
        scorer = make_pair_scorer(typing.cast(roles.PairScorer, head), *fields, device=device)
        with _bar(queries * searched, "ranking every pair", "pair") as bar:
            counted = _counted(scorer, bar, lambda q_ids, g_ids: len(q_ids) * len(g_ids))
            n_gallery = searched - 1 if same else searched
            ranked = score(
                pair_scorer=counted, pair_chunks=pair_chunks(n_gallery), per_query=per_query
            )
        ranked["num_ranked_candidates"] = n_gallery
        return ranked
    reranker = make_reranker(typing.cast(roles.Reranker, head), *fields, device=device)
    with _bar(queries, f"re-ranking the top {rerank_k}", "query") as bar:
        counted = _counted(reranker, bar, lambda q_ids, _: len(q_ids))
        ranked = score(reranker=counted, rerank_k=rerank_k, per_query=per_query)
    ranked["num_ranked_candidates"] = rerank_k
    return ranked


def _bar(total: int, what: str, unit: str) -> tqdm:
    """A progress bar of ``total`` units (its rate and the time left), shown only at a
    terminal and gone when done."""
    return tqdm(
        total=total,
        desc=what,
        unit=unit,
        unit_scale=True,
        leave=False,
        disable=None,
        file=sys.stderr,
    )


def _counted(call, bar: tqdm, count):
    """``call`` (a pair scorer or a re-ranker: ``(query ids, other ids) -> scores``), moving
    ``bar`` on by ``count(query ids, other ids)`` after each call."""

    def counted(query_ids, other_ids):
        out = call(query_ids, other_ids)
        bar.update(count(query_ids, other_ids))
        return out

    return counted


def head_ranking(head: object) -> tuple[bool, int, tuple[str, ...]]:
    """How the evaluation ranks by ``head``'s roles: (exhaustively by a
    :class:`~harness.methods.roles.PairScorer`'s pair scores, the candidates per query a
    :class:`~harness.methods.roles.Reranker` re-scores, the head fields kept per image)."""
    if isinstance(head, roles.PairScorer) and head.rerank_fields and head.exhaustive_pairs:
        return True, 0, head.rerank_fields
    if isinstance(head, roles.Reranker) and head.rerank_fields and head.rerank_k > 0:
        return False, head.rerank_k, head.rerank_fields
    return False, 0, ()


def _embed_sets(
    model: EmbeddingModel,
    query_set,
    gallery_set,
    protocol: BenchmarkProtocol,
    *,
    device: torch.device,
    workers: int,
    keep: tuple[str, ...],
):
    """Embeddings and kept head fields of ``query_set``, then of ``gallery_set``: ``(q,
    q_fields, g, g_fields)``, with ``g`` None and ``g_fields`` the query's without a gallery."""
    transform = build_transform(protocol.image, train=False)

    def embed(images):
        return embed_images(
            model,
            images,
            transform,
            protocol.image,
            batch_size=protocol.evaluation.batch_size,
            device=device,
            workers=workers,
            keep=keep,
            precision=protocol.numerics.precision,
        )

    q, q_fields = embed(query_set)
    if gallery_set is None:
        return q, q_fields, None, q_fields
    g, g_fields = embed(gallery_set)
    return q, q_fields, g, g_fields


def _with_global(ranked: Scores, plain: Scores) -> Scores:
    """The method's ranking ``ranked`` with the plain cosine ranking's metrics (``num_*``
    counts left out) under ``global_`` names, and ``ranked``'s per-query values."""
    out = Scores(
        {**ranked, **{f"global_{k}": v for k, v in plain.items() if not k.startswith("num_")}}
    )
    out.per_query = ranked.per_query
    return out


def _embedded(scores: Scores, queries: np.ndarray, gallery: np.ndarray | None) -> EmbeddedScores:
    """``scores`` (and their per-query values) with the embeddings they were computed from."""
    out = EmbeddedScores(scores)
    out.per_query = scores.per_query
    out.embeddings = (queries, gallery)
    return out


@typing.runtime_checkable
class Evaluator(typing.Protocol):
    """What a :class:`~harness.engine.run.trainer.Trainer` scores a model with: ``split``
    ``"val"`` (the selection on validation) or ``"test"`` (the test split, searched against
    its gallery where it has one), the ``metrics`` named; ``per_query``: keep the per-query
    values behind every retrieval mean (``result.per_query``)."""

    def __call__(
        self,
        model: EmbeddingModel,
        split: str,
        *,
        metrics: tuple[str, ...],
        per_query: bool = False,
    ) -> Scores: ...


@dataclass
class SplitEvaluator:
    """The :class:`Evaluator` of a run: :func:`evaluate_split` on its ``splits`` under its
    protocol (the dataset's recall@k), on ``device`` with ``workers`` loading processes."""

    splits: DatasetSplits
    protocol: BenchmarkProtocol
    dataset: str
    device: torch.device = torch.device("cpu")
    workers: int = 0

    def __call__(
        self,
        model: EmbeddingModel,
        split: str,
        *,
        metrics: tuple[str, ...],
        per_query: bool = False,
    ) -> Scores:
        if split not in ("val", "test"):
            raise HarnessError(f"no split '{split}' to evaluate (val or test)")
        queries, gallery = (
            (self.splits.val, None) if split == "val" else (self.splits.test, self.splits.gallery)
        )
        return evaluate_split(
            model,
            queries,
            gallery,
            self.protocol,
            self.dataset,
            device=self.device,
            workers=self.workers,
            metrics=metrics,
            per_query=per_query,
        )
