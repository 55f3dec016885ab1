"""Mining and the margin loss in a fixed shape against PML's index lists.

Workload: one training step's mining and loss (forward and backward) on random unit
embeddings of a P x K batch (classes x images per class), for the three distance-weighted
and hard-negative miners the protocols name, each in its indexed form (the index lists
PML's losses take) and its fixed-shape form (:class:`~harness.components.losses.mined.MinedTriplets`,
the loss over a mask). Reported per batch shape and miner: the operations with a
data-dependent shape and the reads of the device per call (``SyncCounter``; on a GPU each
is a stall), the slots each form computes the loss on, and the median time per call.

Usage: python benchmarks/bench_fixed_shape_mining.py [--repeats 30] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from harness.base.syncs import SyncCounter
from harness.components.losses import apply_loss, create_loss, create_miner

#: (classes per batch, images per class): the smoke protocol's and the papers' batches.
SHAPES = ((16, 2), (28, 4), (56, 2))
#: (indexed form, fixed-shape form) of each miner the protocols name.
PAIRS = (
    ("distance_weighted", "distance_weighted_fixed"),
    ("distance_weighted_roth_indexed", "distance_weighted_roth"),
    ("hard_negative_indexed", "hard_negative"),
)
DIM = 128


def _step(miner, loss, emb: torch.Tensor, labels: torch.Tensor) -> int:
    x = emb.detach().requires_grad_()
    mined = miner(x.detach(), labels)
    apply_loss(loss, x, labels, mined).backward()
    return len(mined) if not isinstance(mined, tuple) else len(mined[0])


def measure(name: str, classes: int, per_class: int, repeats: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    labels = (torch.arange(classes * per_class) // per_class).to(device)
    emb = F.normalize(torch.randn(len(labels), DIM, generator=gen), dim=1).to(device)
    miner = create_miner(name)
    loss = create_loss("margin", num_classes=classes, embedding_size=DIM).to(device)
    with SyncCounter() as counter:
        slots = _step(miner, loss, emb, labels)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _step(miner, loss, emb, labels)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {
        "miner": name,
        "batch": f"{classes} x {per_class}",
        "shape_dependent": counter.shape_dependent,
        "device_reads": counter.scalar_reads + counter.device_to_host,
        "slots": slots,
        "median_ms": round(1000 * statistics.median(times), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [
        measure(name, classes, per_class, args.repeats, args.device)
        for classes, per_class in SHAPES
        for pair in PAIRS
        for name in pair
    ]
    print("| batch | miner | data-dependent shapes | device reads | slots | median |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['miner']} | {r['shape_dependent']} | {r['device_reads']} "
            f"| {r['slots']} | {r['median_ms']} ms |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
