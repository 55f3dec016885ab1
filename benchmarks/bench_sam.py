"""SAM's training cost against ``plain`` on the same backbone: images/s, FLOPs, passes.

SAM (harness/methods/sam.py) trains the plain head with a second pass over soft-masked images
(similarity mining, Eq. 2-3): each step embeds the batch, computes the attention of the
selected tuples' images (closed form on the last map; a double backward on an earlier
stage), masks at most one batch of images and embeds them again, and backpropagates
through both passes. Its cost is therefore about (images through the backbone per step)
/ (batch size) times plain's, i.e. about 2 (the masked pass holds at most one batch:
k * (B // k) images under the default fixed-shape selection, fewer under
``selection=host`` when the batch's tuples do not cover every image). This benchmark reports that
pass count beside the measured slowdown (plain's rate / SAM's) and the FLOP ratio
(forward + backward per training image, ``torch.utils.flop_counter``). Expected:
slowdown near the pass count, not above ~3.

Both models are built by the harness (``build_model``: same backbone, same protocol)
and trained by the harness loop's step: forward under autocast (CUDA), the head's
``loss_terms`` with the protocol's metric loss and miner, backward, optimizer step.
Steps of the two models are interleaved (plain, sam, plain, ...) so that background load
hits both alike; the median step time is reported.

Usage: python benchmarks/bench_sam.py [--backbone resnet50] [--size 224] [--batch 16]
       [--steps 6] [--method sam] [--loss triplet] [--option stage=s16 ...] [--device auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(
    method: str, backbone: str, size: int, options: dict, loss_name: str, device: torch.device
):
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
    loss = create_loss(loss_name, num_classes=8, embedding_size=model.head.metric_loss_dim).to(
        device
    )
    optimizer = build_optimizer(protocol, model, loss)
    return model, MetricLoss(loss, create_miner("distance_weighted")), optimizer


def step_fn(model, metric_loss, optimizer, images, labels):
    from harness.methods import TrainingBatch

    def step() -> None:
        with torch.autocast(device_type=images.device.type, enabled=images.device.type == "cuda"):
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
    """FLOPs of one training step per image (the same count as bench_diablo's)."""
    from bench_diablo import (
        flops_per_image as count,  # benchmarks/ is on sys.path when run as a script
    )

    return count(step, batch)


def passes_per_step(model, step, batch: int, steps: int = 3) -> float:
    """Images through the backbone per step, in batches (the masked pass included)."""
    seen = []
    hook = model.backbone.register_forward_pre_hook(lambda _m, args: seen.append(len(args[0])))
    try:
        for _ in range(steps):
            step()
    finally:
        hook.remove()
    return sum(seen) / (steps * batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backbone", default="resnet50", help="the paper's (Sec. 4); any registered backbone"
    )
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--method", default="sam", help="sam, sam_siamese or sam_quadruplet")
    parser.add_argument("--loss", default="triplet", help="the metric loss of both models")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--option", action="append", default=[], help="SAM option, e.g. stage=s16")
    args = parser.parse_args()
    from harness.config.overrides import parse_value
    from harness.engine.run.runtime import resolve_device, seed_everything

    device = resolve_device(args.device)
    options = {k: parse_value(v) for k, v in (o.split("=", 1) for o in args.option)}
    seed_everything(0)
    images = torch.randn(args.batch, 3, args.size, args.size, device=device)
    labels = (torch.arange(args.batch, device=device) // 2) % 8
    steps, flops, passes = {}, {}, {}
    for method, opts in (("plain", {}), (args.method, options)):
        model, metric_loss, optimizer = build(
            method, args.backbone, args.size, opts, args.loss, device
        )
        step = step_fn(model, metric_loss, optimizer, images, labels)
        flops[method] = flops_per_image(step, args.batch)
        passes[method] = passes_per_step(model, step, args.batch)  # also the warm-up
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
        f"{args.size} px, batch {args.batch}, loss {args.loss} + distance-weighted miner, "
        f"{args.method} options {options or 'defaults'}"
    )
    for m in steps:
        print(
            f"{m:>15s}: {rate[m]:8.2f} training images/s, {flops[m] / 1e9:7.2f} GFLOP per training image, "
            f"{passes[m]:.2f} backbone passes per batch"
        )
    slowdown = rate["plain"] / rate[args.method]
    print(
        f"{args.method} / plain: measured slowdown {slowdown:.2f} (images/s ratio plain / {args.method}); "
        f"FLOP ratio {flops[args.method] / flops['plain']:.2f}; pass ratio "
        f"{passes[args.method] / passes['plain']:.2f}"
    )


if __name__ == "__main__":
    main()
