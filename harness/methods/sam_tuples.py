"""SAM's tuples for similarity mining (Zheng et al., IJCAI 2022, Sec. 3.2): which of the
tuples the metric loss's miner chose get masked, each image at most once per step
(:func:`select_tuples`; the rule, a choice where the paper is silent, is named in
:mod:`harness.methods.sam`). The greedy pass runs on the host, in its parallel form on
the device (:func:`disjoint_on_device`), or in a fixed shape on the device
(:func:`select_fixed_tuples`): a fixed number of tuple slots and a mask of the kept ones,
so that the step has no shape that depends on the data and compiles as one graph."""

from __future__ import annotations

import torch
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from harness.components.losses import MinedPairs, MinedTriplets
from harness.methods.sam_attention import TUPLE_SIZE

__all__ = [
    "MININGS",
    "SELECTIONS",
    "candidate_tuples",
    "select_tuples",
    "disjoint_on_device",
    "settle_rounds",
    "candidate_slots",
    "greedy_in_slots",
    "select_fixed_tuples",
    "random_order",
    "random_index",
]

MININGS = ("random", "hardest")
#: Where the greedy pass runs: the sequential loop on the host, its parallel form on the
#: embeddings' device (:func:`disjoint_on_device`; pairs and triplets), or the fixed-shape
#: form on the device (:func:`select_fixed_tuples`; every form).
SELECTIONS = ("host", "device", "fixed")
#: The parallel form's rounds: each settles at least the earliest undecided candidate, and
#: on the batches measured (benchmarks/bench_sam_tuples.py) all settle within 12.
DEVICE_ROUNDS = 32


def candidate_tuples(indices, labels: torch.Tensor, form: str) -> torch.Tensor:
    """The mined tuples as rows: positive pairs (Siamese) or triplets (triplet, quadruplet),
    converted from a miner's pairs (a1, p, a2, n) or triplets (a, p, n) as PML converts them;
    ``indices`` None (no miner): all of the batch's; fixed-shape tuples or pair masks: the
    ones they keep."""
    if isinstance(indices, (MinedTriplets, MinedPairs)):
        indices = indices.compact()
    if form == "siamese":
        a1, p, _, _ = lmu.convert_to_pairs(indices, labels)
        return torch.stack([a1, p], 1)
    a, p, n = lmu.convert_to_triplets(indices, labels, t_per_anchor="all")
    return torch.stack([a, p, n], 1)


def select_tuples(
    indices,
    labels: torch.Tensor,
    form: str,
    embeddings: torch.Tensor | None = None,
    mining: str = "random",
    selection: str = "host",
) -> torch.Tensor:
    """The tuples similarity mining masks, T x k (k = 2, 3, 4), from the mined ``indices``:
    greedily, no image in two tuples; in random order or hardest first; a quadruplet adds a
    second negative to a mined triplet (see :mod:`harness.methods.sam`). Random choices use
    torch's global generator (seeded per epoch by the trainer).

    ``selection="host"``: the greedy pass runs on the host, and what it reads comes over in
    one transfer (:func:`_to_host`); the distances and the hardest-first order are computed
    on the embeddings' device before it. ``"device"`` (pairs and triplets): the same pass in
    its parallel form on the device (:func:`disjoint_on_device`), from the same order
    (the random one drawn from the same CPU generator), so it keeps the same tuples
    wherever its rounds settle every candidate."""
    k = TUPLE_SIZE[form]
    cand = candidate_tuples(indices, labels, form)
    empty = torch.zeros(0, k, dtype=torch.long, device=labels.device)
    if len(cand) == 0:
        return empty
    _check_mining(mining, embeddings)
    if selection not in SELECTIONS[:2]:
        raise ValueError(
            f"selection must be one of {SELECTIONS[:2]} (select_fixed_tuples for 'fixed'), "
            f"got {selection!r}"
        )
    if selection == "device" and form == "quadruplet":
        raise ValueError(
            "selection='device' takes pairs and triplets (a quadruplet's n2 is drawn in turn)"
        )
    dist = hardest_first = None
    if mining == "hardest":
        assert embeddings is not None  # checked above
        hard, dist = _hardness(cand, embeddings, form)
        hardest_first = torch.argsort(-hard, stable=True)
    if selection == "device":
        if hardest_first is None:
            hardest_first = torch.tensor(random_order(len(cand)), device=cand.device)
        kept = disjoint_on_device(cand, hardest_first, batch=len(labels))
        return cand[hardest_first[kept[hardest_first]]]
    # Quadruplets read the labels (n2's class) and, hardest first, the distances (n2's rank).
    quadruplet = form == "quadruplet"
    rows, y, order, dist_rows = _to_host(
        cand, labels if quadruplet else None, hardest_first, dist if quadruplet else None
    )
    if order is None:
        order = random_order(len(rows))
    chosen = _greedy_disjoint(
        rows, y, order, dist_rows, batch=len(labels), form=form, mining=mining
    )
    if not chosen:
        return empty
    return torch.tensor(chosen, dtype=torch.long, device=labels.device)


def _check_mining(mining: str, embeddings: torch.Tensor | None) -> None:
    if mining not in MININGS:
        raise ValueError(f"mining must be one of {MININGS}, got {mining!r}")
    if mining == "hardest" and embeddings is None:
        raise ValueError("mining='hardest' needs the embeddings")


def _hardness(
    cand: torch.Tensor, embeddings: torch.Tensor, form: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """How hard each candidate is, d(a, p) - d(a, n) (d(1, 2) for pairs), and the distance
    matrix it comes from (float32, no gradient)."""
    emb = embeddings.detach().float()
    dist = torch.cdist(emb, emb)
    hard = dist[cand[:, 0], cand[:, 1]]
    if form != "siamese":
        hard = hard - dist[cand[:, 0], cand[:, 2]]
    return hard, dist


def disjoint_on_device(
    cand: torch.Tensor, order: torch.Tensor, *, batch: int, rounds: int = DEVICE_ROUNDS
) -> torch.Tensor:
    """Which candidates (rows of ``cand``, T x k image indices below ``batch``) the greedy
    pass in ``order`` keeps, as a T mask, computed in ``rounds`` fixed-shape rounds on
    ``cand``'s device: the lexicographically first maximal set of candidates that share no
    image, which is what the sequential pass (:func:`_greedy_disjoint`) returns.

    Each round, a candidate that shares an image with a kept one is dropped, and an
    undecided candidate is kept when it comes first in ``order`` among the undecided ones
    on every image it holds: each earlier candidate it meets has then been dropped. The
    first undecided candidate is settled every round, so T rounds always suffice; a
    candidate still undecided after ``rounds`` is not kept (a smaller set, never an image
    twice). A row that repeats an image is never kept, as on the host."""
    return settle_rounds(cand, order, batch=batch, rounds=rounds)[0]


def settle_rounds(
    cand: torch.Tensor, order: torch.Tensor, *, batch: int, rounds: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`disjoint_on_device`'s rounds: the kept mask and the still undecided one."""
    count, k = cand.shape
    rank = torch.empty(count, dtype=torch.long, device=cand.device)
    rank[order] = torch.arange(count, device=cand.device)
    distinct = (cand.sort(dim=1).values.diff(dim=1) != 0).all(dim=1)
    undecided, kept = distinct.clone(), torch.zeros_like(distinct)
    members, last = cand.flatten(), torch.full((batch,), count, device=cand.device)
    for _ in range(rounds):
        held = kept.long().repeat_interleave(k)  # 1 on each image of a kept candidate
        taken = torch.zeros(batch, dtype=torch.long, device=cand.device)
        taken = taken.scatter_reduce(0, members, held, reduce="amax") > 0
        undecided = undecided & ~taken[cand].any(dim=1)
        alive_rank = torch.where(undecided, rank, count).repeat_interleave(k)
        first = last.scatter_reduce(0, members, alive_rank, reduce="amin")
        settled = undecided & (first[cand] == rank[:, None]).all(dim=1)
        kept, undecided = kept | settled, undecided & ~settled
    return kept, undecided


def _to_host(
    cand: torch.Tensor,
    labels: torch.Tensor | None,
    order: torch.Tensor | None,
    dist: torch.Tensor | None,
) -> tuple[list[list[int]], list[int], list[int] | None, list[list[float]]]:
    """One device-to-host transfer of what the greedy pass reads: the candidates (T x k)
    and, where given, the labels, the order and the distance matrix, packed into one float64
    vector (exact: indices and class ids are integers far below 2^53, and every float32
    distance is a float64). Returns them as lists (``[]`` / None where not given)."""
    parts = [t.flatten() for t in (cand, labels, order, dist) if t is not None]
    flat = torch.cat([t.to(torch.float64) for t in parts]).tolist()
    count, k = cand.shape
    rows = [[int(i) for i in flat[r * k : (r + 1) * k]] for r in range(count)]
    pos = count * k
    y: list[int] = []
    if labels is not None:
        y, pos = [int(c) for c in flat[pos : pos + len(labels)]], pos + len(labels)
    host_order = None
    if order is not None:
        host_order, pos = [int(t) for t in flat[pos : pos + count]], pos + count
    batch = 0 if dist is None else len(dist)
    dist_rows = [flat[pos + i * batch : pos + (i + 1) * batch] for i in range(batch)]
    return rows, y, host_order, dist_rows


def random_order(count: int) -> list[int]:
    """A random permutation of the candidates from torch's global generator, the CPU one: a
    host draw that never waits for a device. With :func:`random_index`, the only random
    draws of the host selection (:func:`select_tuples`); a sync count sets them apart
    (tests/engine/test_syncs.py)."""
    return torch.randperm(count).tolist()


def random_index(count: int) -> int:
    """A uniform index below ``count`` from torch's global (CPU) generator: a host draw."""
    return int(torch.randint(count, ()))


def _greedy_disjoint(
    rows: list[list[int]],
    y: list[int],
    order: list[int],
    dist: list[list[float]],
    *,
    batch: int,
    form: str,
    mining: str,
) -> list[list[int]]:
    """The candidates ``rows`` in ``order``, each kept when it shares no image with one kept
    before; a quadruplet adds the nearest (hardest first) or a random unused image of a third
    class (``y``) as n2; stops when fewer than k images are left."""
    k = TUPLE_SIZE[form]
    used, chosen, free = [False] * batch, [], batch
    for t in order:
        members = rows[t]
        if len(set(members)) < len(members) or any(used[i] for i in members):
            continue
        if form == "quadruplet":
            a, n1 = members[0], members[2]
            pool = [
                j
                for j in range(batch)
                if not used[j] and j not in members and y[j] != y[a] and y[j] != y[n1]
            ]
            if not pool:
                continue
            n2 = (
                min(pool, key=lambda j: dist[a][j])
                if mining == "hardest"
                else pool[random_index(len(pool))]
            )
            members = members + [n2]
        chosen.append(members)
        for i in members:
            used[i] = True
        free -= k
        if free < k:
            break
    return chosen


# ------------------------------------------------------------------ the fixed shape


def _all_tuples(labels: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, form: str):
    """Every pair (i, j) or triplet (a, p, n) of the batch in row-major order, with a mask:
    (i, j) where ``positive[i, j]``, (a, p, n) where ``positive[a, p]`` and
    ``negative[a, n]`` (B x B masks). The order is PML's: ``torch.where`` over the same
    masks lists them row by row."""
    b = len(labels)
    idx = torch.arange(b, device=labels.device)
    if form == "siamese":
        i, j = idx.repeat_interleave(b), idx.repeat(b)
        return torch.stack([i, j], 1), positive.flatten()
    a, p, n = (
        idx.repeat_interleave(b * b),
        idx.repeat_interleave(b).repeat(b),
        idx.repeat(b * b),
    )
    return torch.stack([a, p, n], 1), (positive[:, :, None] & negative[:, None, :]).flatten()


def candidate_slots(indices, labels: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`candidate_tuples` in a fixed shape: T x k candidates (positive pairs, or
    triplets for the triplet and quadruplet forms) and the T mask of those that count, in
    the order :func:`candidate_tuples` lists the counted ones. From fixed-shape triplets
    (:class:`~harness.components.losses.MinedTriplets`) a slot per triplet; from pair masks
    (``MinedPairs``) or no miner (``None``: all of the batch's tuples), a slot per pair or
    triplet of the batch. PML's index lists are converted as they are (every row counts:
    their length is the miner's data-dependent shape)."""
    if isinstance(indices, MinedTriplets):
        columns = [indices.anchors, indices.positives, indices.negatives]
        return torch.stack(columns[: 2 if form == "siamese" else 3], 1), indices.valid
    if isinstance(indices, MinedPairs):
        return _all_tuples(labels, indices.positive, indices.negative, form)
    if indices is None:
        same = labels[:, None] == labels[None, :]
        eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
        return _all_tuples(labels, same & ~eye, ~same, form)
    cand = candidate_tuples(indices, labels, form)
    return cand, torch.ones(len(cand), dtype=torch.bool, device=cand.device)


def greedy_in_slots(
    cand: torch.Tensor,
    valid: torch.Tensor,
    priority: torch.Tensor,
    *,
    batch: int,
    form: str,
    labels: torch.Tensor | None = None,
    n2_score: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The host's greedy pass (:func:`_greedy_disjoint`) in ``batch // k`` fixed rounds on
    the device. Round r keeps the counted candidate of lowest ``priority`` (the first in
    the pass's order; ties to the lower slot, as a stable sort orders them) that shares no
    image with one kept before and, for a quadruplet, has an unused image of a third class
    left; a quadruplet then takes as n2 the image of lowest ``n2_score[a]`` (B x B) in that
    pool. Each kept tuple ends the sequential pass's scan up to it, every candidate it
    skipped stays blocked (the images in use only grow), so the rounds keep the sequential
    pass's tuples in its order. Returns the ``batch // k`` x k tuples and the mask of the
    rounds that kept one (a round that finds none keeps none; its row is a placeholder).
    Quadruplets' triplets are a miner's: p of a's class, n1 of another (the count of a
    pool's images relies on it; n2 is never one of the triplet's images in any case)."""
    k = TUPLE_SIZE[form]
    quadruplet = form == "quadruplet"
    distinct = (cand.sort(dim=1).values.diff(dim=1) != 0).all(dim=1)
    counted = valid & distinct
    used = torch.zeros(batch, dtype=torch.bool, device=cand.device)
    if quadruplet and (labels is None or n2_score is None):
        raise ValueError("quadruplets need the labels and n2_score (n2 is of a third class)")
    y = cand.new_zeros(batch) if labels is None else labels
    score_n2 = priority.new_zeros(batch, batch) if n2_score is None else n2_score
    same_class = y[:, None] == y[None, :]
    last = torch.finfo(priority.dtype).max if priority.is_floating_point() else len(cand)
    rows, kept = [], []
    # No candidate (an index-list miner that found none: a shape the host knows): no slot.
    for _ in range(batch // k if len(cand) else 0):
        free = counted & ~used[cand].any(dim=1)
        if quadruplet:
            # A triplet's pool: unused images of neither a's class (which holds p) nor n1's.
            unused_like = (same_class & ~used).sum(dim=1)  # unused images of i's class
            left = (~used).sum() - unused_like[cand[:, 0]] - unused_like[cand[:, 2]]
            free = free & (left > 0)
        # One-element index tensors throughout: a 0-d one would be read as a Python int.
        pick = torch.where(free, priority, last).argmin()[None]
        members, found = cand[pick][0], free[pick]
        if quadruplet:
            a, n1 = members[:1], members[2:3]
            pool = (~used & (y != y[a]) & (y != y[n1])).index_fill(0, members, False)
            score = score_n2[a][0].masked_fill(~pool, torch.inf)
            members = torch.cat([members, score.argmin()[None]])
        used = used | (torch.zeros_like(used).index_fill(0, members, True) & found)
        rows.append(members)
        kept.append(found[0])
    if not rows:
        return cand.new_zeros(0, k), valid.new_zeros(0)
    return torch.stack(rows), torch.stack(kept)


def select_fixed_tuples(
    indices,
    labels: torch.Tensor,
    form: str,
    embeddings: torch.Tensor | None = None,
    mining: str = "random",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_tuples` in a fixed shape: ``len(labels) // k`` x k tuples and the mask
    of those kept, with no read of the device and no shape that depends on the data.

    ``"hardest"`` keeps the host's tuples in the host's order (the same ranks, ties to the
    earlier candidate). ``"random"`` draws its order on the device (a uniform priority per
    candidate from torch's global generator for the device) and a quadruplet's random n2
    the same way: the host's distribution over tuples, other draws (the host draws from
    the CPU generator); given the host's order, the same tuples
    (tests/methods/test_sam_fixed_tuples.py)."""
    _check_mining(mining, embeddings)
    cand, valid = candidate_slots(indices, labels, form)
    n2_score = None
    if mining == "hardest":
        assert embeddings is not None  # checked above
        hard, n2_score = _hardness(cand, embeddings, form)
        priority = -hard
    else:
        priority = torch.rand(len(cand), device=cand.device)
        if form == "quadruplet":
            n2_score = torch.rand(len(labels), len(labels), device=cand.device)
    return greedy_in_slots(
        cand, valid, priority, batch=len(labels), form=form, labels=labels, n2_score=n2_score
    )
