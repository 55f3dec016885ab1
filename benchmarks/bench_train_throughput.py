"""Training throughput of the harness's step loop against the bare loop, on one device.

Both loops train the same model (the protocol's backbone and the method's head, built by
the harness), with the same metric loss and miner, the same optimizer, the same batches and
the same precision (the autocast the harness picks for the device):

* bare: ``zero_grad``; forward and the head's ``loss_terms`` under autocast; ``backward``;
  ``step``: on batches already normalised on the device, nothing else;
* harness: :meth:`harness.engine.run.trainer.Trainer.train_epoch` over the same batches as the
  loader hands them (uint8, on the host): the copy to the device and normalisation, the
  per-step mining seed, the loss scaler, the on-device loss tally and its read every
  ``[training] sync_every`` steps, the progress bar;
* compiled: the same loop under ``run --compile`` (:mod:`harness.engine.run.compiled_step`,
  its own trainer and model, built alike): forward, loss and backward as one graph where
  the miner works in a fixed shape (``--set miner.name=distance_weighted_fixed``), the
  optimizer step as a second; with ``--cuda-graphs``, replayed as a CUDA graph. Its
  compilation runs in the warm-up round, outside the timing.

The data loader is left out of both (``bench_input_pipeline.py`` measures it with a JPEG
tree): the ratio is the cost of the loop itself, the host syncs above all. The two loops
alternate in rounds of ``--steps`` steps, so background load hits both alike; each rate
is the median over the rounds.

Usage: python benchmarks/bench_train_throughput.py [--protocol smoke] [--method plain]
       [--steps 10] [--rounds 5] [--device auto] [--set KEY=VALUE ...] [--no-compile]
       [--cuda-graphs] [--profile TABLE]
On a GPU: --protocol roth2020 --set backbone.pretrained=false --fast (ResNet-50, 224 px, batch 112).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def build(
    protocol_name: str,
    overrides: list[str],
    method: str,
    steps: int,
    device: torch.device,
    *,
    compile: bool = False,
    cuda_graphs: bool = False,
):
    """The harness's trainer for ``method`` and ``steps`` batches of the protocol's size
    (random uint8 images, the sampler's class-balanced labels), compiled under ``compile``."""
    from harness.config.protocol import apply_overrides
    from harness.config.protocol_files import load_protocol
    from harness.engine.run.data import prepare_splits
    from harness.engine.run.recorder import NullRecorder
    from harness.engine.run.run_config import RunConfig, RunSettings
    from harness.engine.run.trainer import Trainer

    protocol = load_protocol(protocol_name).for_dataset("synthetic")
    protocol, _ = apply_overrides(protocol, [*overrides, f"sampling.batches_per_epoch={steps}"])
    splits = prepare_splits(protocol, "synthetic", None, seed=0)
    cfg = RunConfig.build(
        protocol,
        method=method,
        dataset="synthetic",
        loss=protocol.loss.name,
        seed=0,
        settings=RunSettings(compile=compile, cuda_graphs=cuda_graphs),
    )
    trainer = Trainer.from_config(cfg, splits, recorder=NullRecorder(), device=device)
    generator = torch.Generator().manual_seed(0)
    size, batch = protocol.image.size, protocol.sampling.batch_size
    labels = (torch.arange(batch) // protocol.sampling.samples_per_class) % len(
        set(splits.train.labels)
    )
    batches = [
        (
            torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=generator),
            labels,
            torch.arange(batch),
        )
        for _ in range(steps)
    ]
    trainer.batches.loader = batches  # the harness loop reads its batches from here
    return trainer, batches


def bare_loop(trainer, batches, device: torch.device) -> Callable[[], None]:
    from harness.base.device import amp_dtype
    from harness.components.data.transforms import normalize_batch
    from harness.methods import TrainingBatch

    dtype = amp_dtype(device)
    image = trainer.protocol.image
    ready = [
        (
            normalize_batch(images.to(device), image).contiguous(memory_format=torch.channels_last),
            labels.to(device),
        )
        for images, labels, _ in batches
    ]
    model, head, optimizer = trainer.model, trainer.model.head, trainer.parts.optimizer

    def run() -> None:
        model.train()
        for images, labels in ready:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
                out = model(images)
                loss = sum(
                    head.loss_terms(
                        out, TrainingBatch(labels, trainer.step.metric_loss, images, model)
                    ).values()
                )
            loss.backward()
            optimizer.step()

    return run


def harness_loop(trainer) -> Callable[[], None]:
    epochs = iter(range(10**9))
    return lambda: trainer.train_epoch(next(epochs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--protocol", default="smoke")
    parser.add_argument("--method", default="plain")
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="protocol override"
    )
    parser.add_argument("--no-compile", action="store_true", help="leave the compiled loop out")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="the compiled loop as a CUDA graph"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="TABLE",
        help="after the timing, profile one round of the compiled loop (else the harness loop) "
        "and write torch.profiler's table of its operators, by device time, to TABLE",
    )
    parser.add_argument(
        "--fast",
        action="store_true",
        help="cuDNN autotuning, non-deterministic kernels (run --fast)",
    )
    args = parser.parse_args()
    from harness.base.device import amp_name, configure_determinism
    from harness.engine.run.runtime import resolve_device

    device = resolve_device(args.device)
    configure_determinism(False, fast=args.fast)
    trainer, batches = build(args.protocol, args.set, args.method, args.steps, device)
    protocol = trainer.protocol
    images = len(batches) * protocol.sampling.batch_size
    loops = {"bare": bare_loop(trainer, batches, device), "harness": harness_loop(trainer)}
    if not args.no_compile:
        compiled, _ = build(
            args.protocol,
            args.set,
            args.method,
            args.steps,
            device,
            compile=True,
            cuda_graphs=args.cuda_graphs,
        )
        compiled.batches.loader = batches
        loops["compiled"] = harness_loop(compiled)
    for run in loops.values():  # warm-up: allocator, autotuning, first-call costs
        run()
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, run in loops.items():
            seconds[name].append(timed(run, device))
    rate = {name: images / statistics.median(s) for name, s in seconds.items()}
    print(
        f"device {device} ({torch.get_num_threads()} threads), protocol {protocol.name}: "
        f"{protocol.backbone.name} at {protocol.image.size} px, batch {protocol.sampling.batch_size}, "
        f"autocast {amp_name(device)}, method {args.method}, loss {protocol.loss.name}, "
        f"sync_every {protocol.training.sync_every}, fast {args.fast}; {args.rounds} rounds of {args.steps} steps"
    )
    print(f"bare loop:      {rate['bare']:9.1f} images/s")
    print(f"harness loop:   {rate['harness']:9.1f} images/s")
    print(f"harness / bare: {rate['harness'] / rate['bare']:9.3f}")
    if "compiled" in rate:
        print(f"compiled loop:  {rate['compiled']:9.1f} images/s")
        print(f"compiled / bare: {rate['compiled'] / rate['bare']:8.3f}")
    if args.profile:
        name = "compiled" if "compiled" in loops else "harness"
        write_profile(loops[name], device, args.profile, f"{name} loop, {args.steps} steps")
        print(f"profile of the {name} loop: {args.profile}")


def write_profile(run: Callable[[], None], device: torch.device, path: Path, title: str) -> None:
    """torch.profiler's operator table of one call of ``run``, sorted by the device's time
    (the GPU's when profiled on one, else the CPU's): where a loop's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        timed(run, device)
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{title}, sorted by {key}\n{table}\n")


if __name__ == "__main__":
    main()
