"""DIABLO's training cost against ``plain`` on the same backbone: images/s and FLOPs.

DIABLO's pre-attention runs the backbone's later stages (psi) once per dictionary entry,
so it costs more than the baseline by design. This benchmark measures whether the
implementation loses time beyond that: the measured slowdown (plain's training rate /
DIABLO's) against the ratio of their FLOPs per training image (forward + backward,
counted by ``torch.utils.flop_counter``). Target: slowdown <= 1.25 x FLOP ratio.

Both models are built by the harness (``build_model``: same backbone, same head
options as a run) and trained by the same step as the harness's loop: forward, the
head's ``loss_terms`` with the protocol's metric loss and miner, backward, optimizer
step. Steps of the two models are interleaved (plain, diablo, plain, ...) so that
background load hits both alike; the median step time is reported.

Usage: python benchmarks/bench_diablo.py [--backbone googlenet] [--size 224] [--batch 16]
       [--steps 6] [--option entries=8 ...] [--device auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(method: str, backbone: str, size: int, options: dict, device: torch.device):
    from harness.components.losses import MetricLoss, create_loss, create_miner
    from harness.config.protocol import apply_overrides
    from harness.config.protocol_files import load_protocol
    from harness.engine.run.model import build_model, build_optimizer

    protocol, _ = apply_overrides(
        load_protocol("smoke"),
        {
            "backbone.name": backbone,
            "backbone.pretrained": False,
            "image.size": size,
            "image.resize": size,
            "embedding.size": 512,
        },
    )
    model = build_model(protocol, method, options).to(device).train()
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    loss = create_loss("margin", num_classes=8, embedding_size=model.head.metric_loss_dim).to(
        device
    )
    optimizer = build_optimizer(protocol, model, loss)
    return model, MetricLoss(loss, create_miner("distance_weighted")), optimizer


def step_fn(model, metric_loss, optimizer, images, labels):
    from harness.methods import TrainingBatch

    def step() -> None:
        with torch.autocast(
            device_type=images.device.type,
            enabled=images.device.type == "cuda",
            dtype=torch.bfloat16,
        ):
            out = model(images)
            loss = sum(
                model.head.loss_terms(
                    out, TrainingBatch(labels, metric_loss, images, model)
                ).values()
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def flops_per_image(step, batch: int) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops() / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backbone", default="googlenet", help="the paper's (Sec. 4.1); any registered backbone"
    )
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--option", action="append", default=[], help="DIABLO option, e.g. entries=16"
    )
    args = parser.parse_args()
    from harness.config.overrides import parse_value
    from harness.engine.run.runtime import resolve_device, seed_everything

    device = resolve_device(args.device)
    options = {k: parse_value(v) for k, v in (o.split("=", 1) for o in args.option)}
    seed_everything(0)
    images = torch.randn(args.batch, 3, args.size, args.size, device=device)
    labels = (torch.arange(args.batch, device=device) // 2) % 8
    steps, flops = {}, {}
    for method, opts in (("plain", {}), ("diablo", options)):
        step = step_fn(*build(method, args.backbone, args.size, opts, device), images, labels)
        flops[method] = flops_per_image(step, args.batch)
        step()  # warm-up
        steps[method] = step
    times = {m: [] for m in steps}
    for _ in range(args.steps):
        for method, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[method].append(time.perf_counter() - start)
    rate = {m: args.batch / statistics.median(t) for m, t in times.items()}
    print(
        f"device {device} ({torch.get_num_threads()} threads), backbone {args.backbone} (random init), "
        f"{args.size} px, batch {args.batch}, DIABLO options {options or 'defaults'}"
    )
    for m in steps:
        print(
            f"{m:>7s}: {rate[m]:8.2f} training images/s, {flops[m] / 1e9:7.2f} GFLOP per training image"
        )
    flop_ratio = flops["diablo"] / flops["plain"]
    slowdown = rate["plain"] / rate["diablo"]
    print(
        f"FLOP ratio diablo / plain: {flop_ratio:.2f}; measured slowdown: {slowdown:.2f}; "
        f"slowdown / FLOP ratio: {slowdown / flop_ratio:.2f} (target <= 1.25)"
    )


if __name__ == "__main__":
    main()
