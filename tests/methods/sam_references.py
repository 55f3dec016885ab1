"""Direct transcriptions that SAM's tuple selection is checked against, and the random
mined batches the checks run on (tests/methods/test_sam*.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.methods.sam import TUPLE_SIZE, candidate_tuples

__all__ = ["reference_select", "random_mined_batch"]


def reference_select(indices, labels, form, embeddings=None, mining="random"):
    """The greedy disjoint selection of :func:`select_tuples` written directly: every input
    read on the host separately, the distances of the embeddings' host copy."""
    k = TUPLE_SIZE[form]
    cand = candidate_tuples(indices, labels, form)
    batch = len(labels)
    if len(cand) == 0:
        return torch.zeros(0, k, dtype=torch.long)
    dist = None
    if embeddings is not None and (mining == "hardest" or form == "quadruplet"):
        emb = embeddings.detach().float().cpu()
        dist = torch.cdist(emb, emb)
    rows, y = cand.tolist(), labels.tolist()
    used, chosen, free = [False] * batch, [], batch
    for t in _reference_order(cand, form, mining, dist):
        members = rows[t]
        if len(set(members)) < len(members) or any(used[i] for i in members):
            continue
        if form == "quadruplet":
            n2 = _reference_n2(members, used, y, mining, dist)
            if n2 is None:
                continue
            members = members + [n2]
        chosen.append(members)
        for i in members:
            used[i] = True
        free -= k
        if free < k:
            break
    return torch.tensor(chosen, dtype=torch.long).view(-1, k)


def _reference_order(cand, form, mining, dist) -> list[int]:
    """The order the candidates are tried in: random, or hardest first (stable)."""
    if mining == "random":
        return torch.randperm(len(cand)).tolist()
    hard = dist[cand[:, 0], cand[:, 1]]
    if form != "siamese":
        hard = hard - dist[cand[:, 0], cand[:, 2]]
    return torch.argsort(-hard, stable=True).tolist()


def _reference_n2(members, used, y, mining, dist):
    """A quadruplet's fourth member: a free item of a third class, the nearest to the
    anchor (hardest) or a random one; None when there is none."""
    a, n1 = members[0], members[2]
    pool = [
        j
        for j in range(len(used))
        if not used[j] and j not in members and y[j] != y[a] and y[j] != y[n1]
    ]
    if not pool:
        return None
    if mining == "hardest":
        return min(pool, key=lambda j: float(dist[a, j]))
    return pool[int(torch.randint(len(pool), ()))]


def random_mined_batch(seed):
    """A batch of 12-40 embeddings of 3-8 classes and a random subset of its triplets (as a
    miner hands them over), or no miner (all triplets)."""
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(12, 41, (), generator=g))
    labels = torch.randint(0, int(torch.randint(3, 9, (), generator=g)), (batch,), generator=g)
    emb = F.normalize(torch.randn(batch, 8, generator=g), dim=-1)
    if seed % 4 == 0:
        return None, labels, emb
    same = labels[:, None] == labels[None]
    a, p, n = torch.where(
        same[:, :, None] & ~same[:, None, :] & ~torch.eye(batch, dtype=torch.bool)[:, :, None]
    )
    keep = torch.rand(len(a), generator=g) < 0.3
    return (a[keep], p[keep], n[keep]), labels, emb
