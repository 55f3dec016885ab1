"""The headline command's stages at the standard datasets' real size, on the CPU, each
timed at several fractions of the dataset in one process.

Data: a stand-in tree of ``--dataset`` (sop, inshop, cub200, cars196) per fraction, in the
dataset's official layout with exactly its classes and images per split times the
fraction (``benchmarks/stand_ins.py``; 64 px JPEGs), written once under ``--cache`` and
reused. Its images are meaningless: what is measured is the harness's cost, never a
result.

Measured, for each fraction, in this order (the smoke protocol, as ``run`` reads it):

* verify: ``datasets verify`` (``verify_dataset``, with the command's default threads);
* splits: loading the index files, the protocol's splits (``prepare_splits``) and the
  fingerprint over their digest;
* sampler: one epoch of the training batch sampler, batch indices only;
* loader: the training loader (``TrainingBatches``, the run's default workers on the
  CPU) for ``--batches`` batches, including the workers' start;
* embed: the test split (and In-Shop's gallery) through the smoke backbone
  (EfficientNet-Lite0 at 96 px, ``embed_images``); when a split holds more than
  ``--embed-images`` images, that many are embedded and the time scaled to the split
  (the output says so);
* evaluate: ``evaluate_embeddings`` with every metric and per-query values, on random
  class-clustered embeddings of the split's size and the protocol's dimension;
* record: two runs (``plain`` and ``agrouping``) with those scores and per-query
  values written by ``MlflowRecorder`` into a temporary SQLite store;
* chance: the table's chance row for that test set (``chance_levels``: the default
  draws of random embeddings, each scored by the whole evaluation, the table's default
  metrics): an exact search of every query against the gallery and a k-means with one
  cluster per class, per draw;
* table: ``python -m harness table --chance-draws 0`` over that store, ``agrouping``
  against ``plain`` (the paired bootstrap reads the per-query values); the chance row is
  the stage above.

For each stage: seconds, the peak resident memory of this process during the stage
(sampled every 10 ms from /proc; loader workers are not counted) and the exponent of
cost against the dataset's image count (least squares of log seconds on log images over
the fractions). Written to ``--out``: ``scale.json`` and ``scale.png`` (log-log, one line
per stage). The machine may be shared: timings are wall-clock.

Usage: python benchmarks/bench_scale.py --dataset sop [--fraction 0.1,0.3,1.0]
    [--cache DIR] [--stages verify,splits,...] [--batches 20] [--embed-images 2048]
    [--out results/benchmarks/scale-sop]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from harness.cli.main import main as harness_main
from harness.components.data.sampling import batch_sampler
from harness.components.data.transforms import build_transform
from harness.components.data.verify import verify_dataset
from harness.components.evaluation import METRICS, evaluate_embeddings
from harness.config.fingerprint import fingerprint
from harness.config.protocol_files import load_protocol
from harness.engine.run.checkpoints import RunFolder
from harness.engine.run.data import TrainingBatches, adapted_sampling, prepare_splits
from harness.engine.run.embedding import embed_images
from harness.engine.run.mlflow_recorder import MlflowRecorder
from harness.engine.run.model import build_model, on_device
from harness.engine.run.run_config import RunConfig
from harness.engine.run.runtime import default_workers
from harness.reports.tables import DEFAULT_METRICS
from harness.reports.tables.chance import CHANCE_DRAWS, SplitLabels, chance_levels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stand_ins import stand_in  # the sibling module of this script

STAGES = ("verify", "splits", "sampler", "loader", "embed", "evaluate", "record", "chance", "table")
PROTOCOL = "smoke"
CPU = torch.device("cpu")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------ memory


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class PeakRss:
    """The largest resident set of this process while the block runs (sampled)."""

    def __init__(self, every: float = 0.01):
        self.every, self.peak = every, 0
        self.stop = threading.Event()

    def watch(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self.stop.wait(self.every)

    def __enter__(self) -> PeakRss:
        self.peak = rss_bytes()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())


# ------------------------------------------------------------------------ stages


class Context:
    """What the stages of one fraction pass on to each other."""

    def __init__(self, dataset: str, root: Path, args: argparse.Namespace, work: Path):
        self.dataset, self.root, self.args, self.work = dataset, root, args, work
        self.protocol = load_protocol(PROTOCOL).for_dataset(dataset)
        self.splits: Any = None
        self.fingerprint = ""
        self.scores: Any = None

    def ensure_splits(self) -> Any:
        if self.splits is None:
            self.splits = prepare_splits(self.protocol, self.dataset, self.root, seed=0)
        return self.splits


def stage_verify(ctx: Context) -> dict:
    verify_dataset(ctx.dataset, ctx.root, threads=min(8, os.cpu_count() or 1), say=lambda _: None)
    return {}


def stage_splits(ctx: Context) -> dict:
    ctx.splits = None
    splits = ctx.ensure_splits()
    loss = ctx.protocol.loss.name
    ctx.fingerprint = fingerprint(
        ctx.protocol, splits.digest(), loss=loss, loss_args=ctx.protocol.loss_args(loss)
    )
    return {"train": len(splits.train), "test": len(splits.test)}


def stage_sampler(ctx: Context) -> dict:
    labels = ctx.ensure_splits().train.labels
    classes, per_class, _ = adapted_sampling(ctx.protocol, len(np.unique(labels)))
    sampler = batch_sampler(
        ctx.protocol.sampling,
        labels,
        classes_per_batch=classes,
        samples_per_class=per_class,
        seed=0,
        sample_seeds=True,
        loss=ctx.protocol.loss.name,
    )
    batches = list(iter(sampler))
    return {"batches": len(batches)}


def stage_loader(ctx: Context) -> dict:
    workers = default_workers(CPU)
    built = TrainingBatches.build(
        ctx.protocol, ctx.ensure_splits(), seed=0, device=CPU, workers=workers
    )
    seen = 0
    for seen, _ in enumerate(built.loader, start=1):
        if seen >= ctx.args.batches:
            break
    del built
    return {"batches": seen, "workers": workers}


def embed_time(ctx: Context, images: Any) -> tuple[float, int]:
    """Seconds to embed ``images`` (scaled from the first ``--embed-images`` when more)
    and how many were embedded."""
    model = on_device(build_model(ctx.protocol, "plain", {}), CPU)
    part = images.subset(np.arange(min(len(images), ctx.args.embed_images)))
    start = time.perf_counter()
    embed_images(
        model,
        part,
        build_transform(ctx.protocol.image, train=False),
        ctx.protocol.image,
        batch_size=ctx.protocol.evaluation.batch_size,
        device=CPU,
        workers=default_workers(CPU),
        precision=ctx.protocol.numerics.precision,
    )
    return (time.perf_counter() - start) * len(images) / max(1, len(part)), len(part)


def stage_embed(ctx: Context) -> dict:
    splits = ctx.ensure_splits()
    sets = [s for s in (splits.test, splits.gallery) if s is not None]
    seconds, embedded = 0.0, 0
    for images in sets:
        took, n = embed_time(ctx, images)
        seconds, embedded = seconds + took, embedded + n
    total = sum(len(s) for s in sets)
    note = "" if embedded == total else f"embedded {embedded:,} of {total:,} images, time scaled"
    return {"seconds": seconds, "images": total, "note": note}


def clustered(labels: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """Random embeddings: each image near its class's random centre."""
    rng = np.random.default_rng(seed)
    codes = np.unique(labels, return_inverse=True)[1]
    centres = rng.normal(size=(codes.max() + 1, dim)).astype(np.float32)
    return centres[codes] + rng.normal(scale=0.8, size=(len(labels), dim)).astype(np.float32)


def stage_evaluate(ctx: Context) -> dict:
    splits, dim = ctx.ensure_splits(), ctx.protocol.embedding.size
    queries = clustered(splits.test.labels, dim, 0)
    gallery = None if splits.gallery is None else clustered(splits.gallery.labels, dim, 1)
    ctx.scores = evaluate_embeddings(
        queries,
        splits.test.labels,
        gallery,
        None if splits.gallery is None else splits.gallery.labels,
        recall_k=ctx.protocol.evaluation.recall_k_for(ctx.dataset),
        metrics=METRICS,
        per_query=True,
    )
    return {"metrics": len(METRICS), "queries": len(queries)}


def stage_record(ctx: Context) -> dict:
    splits = ctx.ensure_splits()
    if ctx.scores is None:
        stage_evaluate(ctx)
    for method in ("plain", "agrouping"):
        cfg = RunConfig.build(
            ctx.protocol,
            method=method,
            dataset=ctx.dataset,
            loss=ctx.protocol.loss.name,
            seed=0,
            experiment=ctx.work.name,
        )
        folder = RunFolder(ctx.work / "runs" / method)
        recorder = MlflowRecorder(
            cfg, folder, experiment=ctx.work.name, fingerprint=ctx.fingerprint, splits=splits
        )
        recorder.open()
        recorder.start(None)
        recorder.record_test(ctx.scores, 0)
        recorder.finish(None)
    return {"runs": 2}


def stage_chance(ctx: Context) -> dict:
    splits = ctx.ensure_splits()
    gallery = None if splits.gallery is None else splits.gallery.labels
    levels = chance_levels(SplitLabels(splits.test.labels, gallery), DEFAULT_METRICS)
    return {"metrics": len(levels), "draws": CHANCE_DRAWS}


def stage_table(ctx: Context) -> dict:
    out = ctx.work / "table.md"
    args = ["table", "--experiment", ctx.work.name, "--baseline", "plain", "--out", str(out)]
    args += ["--chance-draws", "0"]  # the chance row is its own stage
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = harness_main(args)
    if code != 0:
        raise SystemExit(f"harness table failed (exit {code})")
    return {}


RUNNERS: dict[str, Callable[[Context], dict]] = {
    name: globals()[f"stage_{name}"] for name in STAGES
}


# ------------------------------------------------------------------------ driver


def run_fraction(dataset: str, fraction: float, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    root, counts, written = stand_in(dataset, fraction, args.cache)
    made = time.perf_counter() - start
    print(
        f"{dataset} at {fraction:g}: stand-in {'written' if written else 'reused'} "
        f"({made:.1f} s) under {root}",
        file=sys.stderr,
    )
    images = counts["train"]["images"] + counts["test"]["images"] + counts["test"]["gallery"]
    stages: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix=f"scale-{dataset}-") as tmp:
        work = Path(tmp) / f"scale-{dataset}-{fraction:g}"
        work.mkdir()
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
        ctx = Context(dataset, root, args, work)
        with contextlib.chdir(work):  # MLflow's artifacts land in the working folder
            for name in args.stages:
                with PeakRss() as peak:
                    began = time.perf_counter()
                    info = RUNNERS[name](ctx)
                    took = time.perf_counter() - began
                seconds = info.pop("seconds", took)
                stages[name] = {"seconds": seconds, "peak_rss_mb": peak.peak / 2**20, **info}
                note = f"  ({info['note']})" if info.get("note") else ""
                print(
                    f"  {name:9s} {seconds:9.2f} s  {peak.peak / 2**20:8.0f} MB{note}",
                    file=sys.stderr,
                )
    return {
        "fraction": fraction,
        "images": images,
        "counts": counts,
        "stand_in_written": written,
        "stand_in_seconds": made,
        "stages": stages,
    }


def exponent(sizes: list[float], seconds: list[float]) -> float | None:
    """Slope of log(seconds) on log(size) by least squares (None under two sizes)."""
    if len(set(sizes)) < 2 or min(seconds) <= 0:
        return None
    return float(np.polyfit(np.log(sizes), np.log(seconds), 1)[0])


def exponents(fractions: list[dict], stages: list[str]) -> dict[str, float | None]:
    sizes = [f["images"] for f in fractions]
    return {s: exponent(sizes, [f["stages"][s]["seconds"] for f in fractions]) for s in stages}


def table_text(result: dict) -> str:
    fractions = result["fractions"]
    head = (
        "stage     "
        + "".join(f" | {f['fraction']:>5g}: s      MB" for f in fractions)
        + " | exponent"
    )
    lines = [head, "-" * len(head)]
    for stage in result["stages"]:
        cells = "".join(
            f" | {f['stages'][stage]['seconds']:9.2f} {f['stages'][stage]['peak_rss_mb']:6.0f}"
            for f in fractions
        )
        power = result["exponents"][stage]
        lines.append(f"{stage:10s}{cells} | {'-' if power is None else f'{power:.2f}'}")
    lines.append("images    " + "".join(f" | {f['images']:>16,}" for f in fractions))
    return "\n".join(lines)


def figure(result: dict, path: Path) -> None:
    fig = Figure(figsize=(7, 5))
    ax = fig.subplots()
    sizes = [f["images"] for f in result["fractions"]]
    for stage in result["stages"]:
        seconds = [f["stages"][stage]["seconds"] for f in result["fractions"]]
        power = result["exponents"][stage]
        label = stage if power is None else f"{stage} (exponent {power:.2f})"
        ax.plot(sizes, seconds, marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="images in the dataset", ylabel="seconds")
    ax.set_title(f"{result['dataset']}: the harness's stages against size ({result['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dataset", required=True, choices=("sop", "inshop", "cub200", "cars196"))
    parser.add_argument("--fraction", default="0.1,0.3,1.0", help="comma-separated fractions")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "dml-harness" / "stand-ins",
        help="where the stand-in trees are written once and reused",
    )
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages")
    parser.add_argument("--batches", type=int, default=20, help="loader batches timed")
    parser.add_argument(
        "--embed-images", type=int, default=2048, help="images embedded per split at most"
    )
    parser.add_argument("--out", type=Path, help="default results/benchmarks/scale-<dataset>")
    args = parser.parse_args(argv)
    args.fractions = sorted(float(f) for f in args.fraction.split(",") if f.strip())
    asked = {s.strip() for s in args.stages.split(",") if s.strip()}
    if unknown := sorted(asked - set(STAGES)):
        parser.error(f"unknown stages {unknown}: expected some of {', '.join(STAGES)}")
    if "table" in asked and "record" not in asked:
        parser.error("the stage table reads the runs of the stage record: ask for both")
    args.stages = [s for s in STAGES if s in asked]  # always in the command's order
    args.out = args.out or Path("results") / "benchmarks" / f"scale-{args.dataset}"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    fractions = [run_fraction(args.dataset, f, args) for f in args.fractions]
    result = {
        "dataset": args.dataset,
        "protocol": PROTOCOL,
        "device": f"cpu, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "stages": args.stages,
        "fractions": fractions,
        "exponents": exponents(fractions, args.stages),
        "peak_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(json.dumps(result, indent=2))
    figure(result, args.out / "scale.png")
    print(table_text(result))
    print(f"written to {args.out / 'scale.json'} and {args.out / 'scale.png'}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
