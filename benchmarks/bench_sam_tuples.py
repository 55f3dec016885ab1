"""SAM's tuple selection (``harness.methods.sam_tuples``): the greedy pass on the host
(``select_tuples``) against its parallel form on the device (``disjoint_on_device``) and
its fixed-shape form (``select_fixed_tuples``, SAM's default).

Workload: the candidates a miner hands SAM, on random unit embeddings of a P x K batch
(classes x images per class): every triplet of the batch (PML's ``t_per_anchor="all"``,
what SAM converts a miner's pairs into) or its positive pairs, in random or hardest-first
order. For each seed, both selections run from the same order (the random one drawn from
the same CPU generator state); reported per batch shape: the candidates, how many seeds
give the same tuples in the same order, the rounds the parallel form needs to settle
every candidate (its fixed count is ``DEVICE_ROUNDS``), and the median time of each; for
the fixed-shape form (B // k rounds), which draws a random order of its own, how many
seeds give the host's tuples hardest first, and its median time.

Usage: python benchmarks/bench_sam_tuples.py [--seeds 20] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from harness.methods.sam_tuples import (
    DEVICE_ROUNDS,
    candidate_tuples,
    select_fixed_tuples,
    select_tuples,
    settle_rounds,
)

#: (classes per batch, images per class): the smoke protocol's and the papers' batches.
SHAPES = ((16, 2), (8, 4), (45, 4), (30, 4))


def rounds_to_settle(cand: torch.Tensor, order: torch.Tensor, batch: int) -> int:
    """The fewest rounds after which no candidate is undecided."""

    def settled(rounds: int) -> bool:
        return not settle_rounds(cand, order, batch=batch, rounds=rounds)[1].any()

    high = 1
    while not settled(high):
        high *= 2
    low = high // 2  # not settled (or 0)
    while low + 1 < high:
        mid = (low + high) // 2
        low, high = (low, mid) if settled(mid) else (mid, high)
    return high


def timed(fn) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure(classes: int, per_class: int, form: str, mining: str, seeds: int, device: str):
    batch = classes * per_class
    labels = torch.arange(classes, device=device).repeat_interleave(per_class)
    same, same_fixed, rounds, host_s, device_s, fixed_s, count = 0, 0, [], [], [], [], 0
    for seed in range(seeds):
        torch.manual_seed(seed)
        emb = torch.nn.functional.normalize(torch.randn(batch, 64, device=device), dim=1)
        indices = lmu.get_all_triplets_indices(labels)
        state = torch.get_rng_state()
        host, t_host = timed(lambda i=indices, e=emb: select_tuples(i, labels, form, e, mining))
        torch.set_rng_state(state)
        on_device, t_device = timed(
            lambda i=indices, e=emb: select_tuples(i, labels, form, e, mining, selection="device")
        )
        same += int(torch.equal(host, on_device))
        (rows, kept), t_fixed = timed(
            lambda i=indices, e=emb: select_fixed_tuples(i, labels, form, e, mining)
        )
        same_fixed += int(torch.equal(rows[kept], host))
        host_s.append(t_host)
        device_s.append(t_device)
        fixed_s.append(t_fixed)
        cand = candidate_tuples(indices, labels, form)
        count = len(cand)
        order = torch.randperm(len(cand), device=device)
        rounds.append(rounds_to_settle(cand, order, batch))
    return {
        "batch": f"{classes} x {per_class}",
        "form": form,
        "mining": mining,
        "candidates": count,
        "same_tuples": f"{same}/{seeds}",
        "rounds_to_settle_max": max(rounds),
        "rounds_to_settle_median": statistics.median(rounds),
        "host_ms": round(1e3 * statistics.median(host_s), 2),
        "device_ms": round(1e3 * statistics.median(device_s), 2),
        # The fixed shape draws its random order on the device: the same tuples hardest first.
        "fixed_same_tuples": f"{same_fixed}/{seeds}" if mining == "hardest" else "-",
        "fixed_ms": round(1e3 * statistics.median(fixed_s), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    rows = [
        measure(classes, per_class, form, mining, args.seeds, args.device)
        for classes, per_class in SHAPES
        for form in ("triplet", "siamese")
        for mining in ("random", "hardest")
    ]
    print(
        f"fixed rounds of the device form: {DEVICE_ROUNDS}; torch threads {torch.get_num_threads()}"
    )
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
