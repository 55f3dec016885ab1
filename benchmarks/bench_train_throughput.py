"""Training throughput of the harness vs the bare backbone (issue: harness overhead <= 15%).

Measures, at the ``smoke`` protocol's batch size and image size, on the same device:

* bare: the backbone alone, forward + backward of ``maps.sum()`` on a fixed random
  batch (no data loading, no head, no loss, no optimizer), BN frozen as in the protocol;
* harness: ``python -m harness run --methods plain`` images/s in its second epoch
  (steady state: real images decoded and augmented, head, metric loss + miner,
  optimizer step, progress bar), read back from the MLflow store.

Usage: python benchmarks/bench_train_throughput.py [--batches 30] [--method plain]
Run it on an otherwise idle machine; it prints both rates and their ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from harness.base.metric_keys import metric_key


def bare_backbone_rate(protocol, batches: int, device: torch.device) -> float:
    from harness.components.backbones import create_backbone

    b = protocol.backbone
    backbone = create_backbone(b.name, pretrained=b.pretrained, freeze_bn=b.freeze_bn).to(device).train()
    size = protocol.image.size
    batch = torch.randn(protocol.sampling.batch_size, 3, size, size, device=device)
    for _ in range(3):  # warm-up
        backbone(batch)[-1].sum().backward()
    start = time.perf_counter()
    for _ in range(batches):
        backbone.zero_grad(set_to_none=True)
        backbone(batch)[-1].sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return batches * len(batch) / (time.perf_counter() - start)


def harness_rate(method: str, batches: int, device: str, workers: int | None) -> float:
    import mlflow

    from harness.cli.main import main

    workdir = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
    os.chdir(workdir)
    out = workdir / "out.json"
    code = main(["run", "--methods", method, "--epochs", "2", "--device", device, "--json", str(out),
                 "--set", f"sampling.batches_per_epoch={batches}", "--set", "selection.mode=last",
                 *(["--workers", str(workers)] if workers is not None else [])])
    assert code == 0
    import json

    run_id = json.loads(out.read_text())[0]["mlflow_run_id"]
    history = mlflow.MlflowClient().get_metric_history(run_id, metric_key("system", "train_images_per_s"))
    return next(m.value for m in history if m.step == 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--method", default="plain")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workers", type=int, help="data-loading processes (default: the run's default)")
    args = parser.parse_args()
    from harness.config.protocol import load_protocol
    from harness.engine.training import resolve_device

    device = resolve_device(args.device)
    protocol = load_protocol("smoke")
    print(f"device {device}, torch threads {torch.get_num_threads()}, batch {protocol.sampling.batch_size}, "
          f"image {protocol.image.size} px, backbone {protocol.backbone.name}")
    bare = bare_backbone_rate(protocol, args.batches, device)
    print(f"bare backbone forward+backward: {bare:8.1f} images/s")
    harness = harness_rate(args.method, args.batches, str(device.type), args.workers)
    print(f"harness training ({args.method}):  {harness:8.1f} images/s")
    print(f"ratio harness / bare:           {harness / bare:8.3f}  (target >= 0.85)")


if __name__ == "__main__":
    main()
