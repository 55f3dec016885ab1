"""Harness training images/s on real JPEG files (and on ``synthetic``) against the bare
backbone, in one process, on whatever device is present.

Data: a tree in the official CUB-200-2011 layout (``CUB_200_2011/images/NNN.Name/*.jpg``,
``images.txt``, ``image_class_labels.txt``; classes 1-100 train, 101-200 test) written to a
temporary folder and removed afterwards: ``--per-class`` procedural JPEGs per class at
CUB's typical size (500 x 375, quality 90): a smooth background, a class-coloured
ellipse, noise.

Measured, for each dataset:

* loader: the training loader alone (the run's dataset, transforms, sampler and
  workers, no model): what decoding and augmentation can deliver;
* harness: ``python -m harness run --methods plain`` images/s in its last epoch (steady
  state, persistent workers), read back from its MLflow store;
* bare: the backbone alone, forward + backward of the last map's sum on a fixed
  random batch of the protocol's size, BN frozen as in the protocol, channels-last,
  under the autocast the harness uses (bf16 on CUDA where supported, fp16 on older
  GPUs, fp32 on CPU); no data, head, loss or optimizer.

Target (issue 16): harness / bare >= 0.85 on an H100-class GPU with ``roth2020``.
Default protocol: ``roth2020`` (ResNet-50, 224 px, batch 112) on CUDA, ``smoke``
(EfficientNet-Lite0, 96 px, batch 32) on the CPU, where ResNet-50 would take minutes
per batch. The machine may be shared: timings are wall-clock.

Usage: python benchmarks/bench_input_pipeline.py [--device auto] [--protocol roth2020]
    [--datasets cub200,synthetic] [--batches 30] [--epochs 2] [--workers N] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from harness.base.metric_keys import metric_key

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: CUB's typical image size (width x height) and the JPEG quality of the tree.
WIDTH, HEIGHT, QUALITY = 500, 375, 90


# --------------------------------------------------------------------------- data


def _picture(rng: np.random.Generator, colour: np.ndarray) -> np.ndarray:
    """HEIGHT x WIDTH x 3 uint8: a smooth two-colour background, an ellipse of the class's
    colour at a random place and size, sensor-like noise."""
    ys, xs = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    a, b = rng.uniform(0, 255, (2, 3)).astype(np.float32)
    t = (xs / WIDTH * rng.uniform(0.3, 1) + ys / HEIGHT * rng.uniform(0.3, 1))[..., None] / 2
    image = a * (1 - t) + b * t
    cy, cx = rng.uniform(0.3, 0.7) * HEIGHT, rng.uniform(0.3, 0.7) * WIDTH
    ry, rx = rng.uniform(0.15, 0.35) * HEIGHT, rng.uniform(0.15, 0.35) * WIDTH
    inside = ((ys - cy) / ry) ** 2 + ((xs - cx) / rx) ** 2 <= 1
    image[inside] = colour
    image += rng.normal(0, 12, image.shape).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_cub_tree(root: Path, per_class: int, seed: int = 0) -> Path:
    """The official CUB layout under ``root`` with ``per_class`` JPEGs in each of 200 classes."""
    from PIL import Image

    base = root / "CUB_200_2011"
    rng = np.random.default_rng(seed)
    images, labels, image_id = [], [], 1
    for c in range(1, 201):
        folder = f"{c:03d}.Bird_{c}"
        (base / "images" / folder).mkdir(parents=True, exist_ok=True)
        colour = rng.uniform(0, 255, 3).astype(np.float32)
        for i in range(per_class):
            rel = f"{folder}/Bird_{c}_{i:04d}.jpg"
            Image.fromarray(_picture(rng, colour)).save(base / "images" / rel, quality=QUALITY)
            images.append(f"{image_id} {rel}")
            labels.append(f"{image_id} {c}")
            image_id += 1
    (base / "images.txt").write_text("\n".join(images) + "\n")
    (base / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    return base


# ------------------------------------------------------------------------ measures


def bare_backbone_rate(protocol, batches: int, device: torch.device) -> float:
    from harness.base.device import amp_dtype
    from harness.components.backbones import create_backbone

    b = protocol.backbone
    backbone = create_backbone(b.name, pretrained=False, freeze_bn=b.freeze_bn).to(device).train()
    backbone = backbone.to(memory_format=torch.channels_last)
    size = protocol.image.size
    batch = torch.randn(protocol.sampling.batch_size, 3, size, size, device=device)
    batch = batch.contiguous(memory_format=torch.channels_last)
    dtype = amp_dtype(device)

    def step():
        backbone.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
            loss = backbone(batch)[-1].float().sum()
        loss.backward()

    for _ in range(3):  # warm-up (cuDNN autotuning, allocator)
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(batches):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return batches * len(batch) / (time.perf_counter() - start)


def loader_rate(
    protocol, dataset: str, data_root: Path | None, batches: int, workers: int
) -> float:
    """The training loader alone: images/s over ``batches`` batches after the first."""
    from torch.utils.data import DataLoader

    from harness.components.data.sampling import ClassBalancedBatchSampler, TransformedImages
    from harness.components.data.transforms import build_transform
    from harness.engine.run.data import adapted_sampling, prepare_splits

    splits = prepare_splits(protocol, dataset, data_root, seed=0)
    classes, per_class, _ = adapted_sampling(protocol, len(np.unique(splits.train.labels)))
    sampler = ClassBalancedBatchSampler(
        splits.train.labels,
        classes_per_batch=classes,
        samples_per_class=per_class,
        batches_per_epoch=batches + 1,
        sample_seeds=True,
    )
    data = TransformedImages(splits.train, build_transform(protocol.image, train=True))
    loader = DataLoader(data, batch_sampler=sampler, num_workers=workers)
    seen, start = 0, None
    for images, _, _ in loader:
        if start is None:  # the first batch pays for starting the workers
            start = time.perf_counter()
            continue
        seen += len(images)
    return seen / (time.perf_counter() - start)


def harness_rate(
    protocol_name: str,
    dataset: str,
    data_root: Path | None,
    batches: int,
    epochs: int,
    device: str,
    workers: int | None,
    workdir: Path,
) -> dict:
    import mlflow

    from harness.cli.main import main

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
    out = workdir / f"{dataset}.json"
    # Random initial weights (speed does not depend on them; a GPU machine may have none cached).
    args = [
        "run",
        "--methods",
        "plain",
        "--protocol",
        protocol_name,
        "--dataset",
        dataset,
        *(["--data-root", str(data_root)] if data_root is not None else []),
        "--epochs",
        str(epochs),
        "--device",
        device,
        "--set",
        "backbone.pretrained=false",
        "--checkpoint-root",
        str(workdir / "checkpoints"),
        "--json",
        str(out),
        "--set",
        f"sampling.batches_per_epoch={batches}",
        "--set",
        "selection.mode=last",
        *(["--workers", str(workers)] if workers is not None else []),
    ]
    with contextlib.chdir(workdir):
        code = main(args)
    if code != 0:
        raise SystemExit(f"harness run on {dataset} failed (exit {code})")
    run_id = json.loads(out.read_text())[0]["mlflow_run_id"]
    client = mlflow.MlflowClient()
    rates = [
        m.value
        for m in sorted(
            client.get_metric_history(run_id, metric_key("system", "train_images_per_s")),
            key=lambda m: m.step,
        )
    ]
    return {
        "per_epoch": rates,
        "steady": rates[-1],
        "amp": client.get_run(run_id).data.tags.get("amp"),
    }


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--protocol", help="default: roth2020 on CUDA, smoke on the CPU")
    parser.add_argument(
        "--datasets", default="cub200,synthetic", help="cub200 (the JPEG tree) and/or synthetic"
    )
    parser.add_argument(
        "--per-class", type=int, default=2, help="JPEGs per CUB class (200 classes)"
    )
    parser.add_argument("--batches", type=int, default=30, help="batches per epoch")
    parser.add_argument(
        "--epochs", type=int, default=2, help="the last one is the steady-state rate"
    )
    parser.add_argument("--workers", type=int, help="loader processes (default: the run's default)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from harness.config.protocol_files import load_protocol
    from harness.engine.run.runtime import resolve_device

    device = resolve_device(args.device)
    protocol_name = args.protocol or ("roth2020" if device.type == "cuda" else "smoke")
    workers = args.workers if args.workers is not None else (4 if device.type == "cuda" else 0)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="bench-input-"))
    result: dict = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "protocol": protocol_name,
        "workers": workers,
        "batches_per_epoch": args.batches,
        "epochs": args.epochs,
        "datasets": {},
    }
    try:
        data_root = workdir / "data"
        if "cub200" in datasets:
            t = time.perf_counter()
            write_cub_tree(data_root, args.per_class)
            print(
                f"wrote {200 * args.per_class} JPEGs ({WIDTH} x {HEIGHT}, q{QUALITY}) in "
                f"{time.perf_counter() - t:.1f} s",
                file=sys.stderr,
            )
        for dataset in datasets:
            # synthetic lives in the usual data root (generated once, then reused).
            root = None if dataset == "synthetic" else data_root
            protocol = load_protocol(protocol_name).for_dataset(dataset)
            bare = bare_backbone_rate(protocol, args.batches, device)
            loader = loader_rate(protocol, dataset, root, args.batches, workers)
            harness = harness_rate(
                protocol_name,
                dataset,
                root,
                args.batches,
                args.epochs,
                device.type,
                args.workers,
                workdir,
            )
            result["datasets"][dataset] = {
                "bare_images_per_s": bare,
                "loader_images_per_s": loader,
                "harness_images_per_s": harness["steady"],
                "harness_per_epoch": harness["per_epoch"],
                "amp": harness["amp"],
                "ratio_harness_over_bare": harness["steady"] / bare,
            }
            print(
                f"{dataset:10s} bare {bare:8.1f}  loader {loader:8.1f}  harness {harness['steady']:8.1f} "
                f"images/s  ratio {harness['steady'] / bare:.3f} (target >= 0.85)",
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
