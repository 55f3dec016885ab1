"""Benchmark of AVSL's exhaustive ranking by the learned distance d^ (``harness.methods.avsl``) on 2 CPU threads.

Workload: a CUB-sized test set (default 5,924 images, 100 classes, 3 levels, r = 512)
of stored node data (unit embeddings per level: a class centre plus noise, more noise at
lower levels; CAM stds uniform in [0, 0.02]; edges from random non-negative matrices;
alpha = 1, beta = 0, the code's gain 10). Every query of a subset (``--queries``,
default 64, extrapolated to the whole set) is ranked against the whole gallery.

Measured, each in a fresh subprocess. Memory is the ranking's own: the peak resident set
(``VmHWM``) during the ranking minus the resident set just before it, the peak being reset
(``/proc/self/clear_refs``) once the data are built, so the ~0.8 GiB that importing torch
and the harness costs both modes is not counted (the process's whole peak is reported too):

(a) the harness: ``harness.components.evaluation.exhaustive_knn`` over ``AVSLHead.score_pairs``
    (``make_pair_scorer``, gallery chunks of ``PAIRS_PER_CALL`` pairs, a running top-k);
(b) the released tester's approach, reimplemented in our own words: per slice of
    queries, the slice x N x r node tensors of every level at once, the slice x N
    distance matrix, then a full argsort of each row. The code ranks CUB and Cars as one
    slice (the whole N x N x r tensors: 5,924^2 x 512 floats = 67 GiB each, beyond this
    machine's 24 GiB) and SOP in ``split_num`` slices: here slices of ``--slice`` queries
    (default 256), and the whole-matrix memory is extrapolated from it (every tensor is
    slice x N x r, so memory is linear in the slice).

Pairs/s and peak memory for both; and, on the same queries, how far a top-K re-ranking
of the top-level cosine candidates (K = 100, 1,000) is from the exhaustive ranking
(P@1 and MAP@R, self excluded, R = class size - 1).

Usage: ``python benchmarks/bench_avsl_ranking.py [--images 5924] [--queries 256] [--slice 256] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

THREADS = 2
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.components.evaluation import exhaustive_knn  # noqa: E402
from harness.components.evaluation.metrics import relevant_counts, retrieval_metrics  # noqa: E402
from harness.engine.run.embedding import make_pair_scorer, pair_chunks  # noqa: E402
from harness.methods import create_method  # noqa: E402

LEVELS, R = 3, 512


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak() -> int:
    """Reset the peak resident set (Linux >= 4.0) and return the current one, KiB."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kib("VmRSS")


def make_data(n: int, classes: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    levels = []
    for _level, noise in enumerate((5.0, 4.5, 4.0)):
        centres = torch.randn(classes, R, generator=g)
        levels.append(F.normalize(centres[labels] + noise * torch.randn(n, R, generator=g), dim=-1))
    cert = 0.02 * torch.rand(n, LEVELS, R, generator=g)
    return torch.stack(levels, 1), cert, labels.numpy()


def make_head():
    head = create_method(
        "avsl", channels={"s8": 8, "s16": 16, "s32": 32}, embedding_size=R, reliability_gain=10.0
    )
    g = torch.Generator().manual_seed(1)
    for buf in head.edge_buffers():
        buf.copy_(torch.rand(R, R, generator=g))
    return head.eval()


def code_style(head, q_lev, q_cert, g_lev, g_cert) -> torch.Tensor:
    """The released tester's slice: all slice x N x r node tensors at once, then argsort."""
    edges = head.edge_matrices()
    hat = None
    for level in range(LEVELS):
        delta = (q_lev[:, None, level] - g_lev[None, :, level]).abs().pow(2)
        if hat is None:
            hat = delta
        else:
            p = torch.sigmoid(
                head.reliability_gain
                * (
                    q_cert[:, None, level] * g_cert[None, :, level] * head.alphas[level - 1]
                    + head.betas[level - 1]
                )
            )
            hat = delta * p + torch.matmul(hat, edges[level - 1].t()) * (1 - p)
    return torch.argsort(hat.sum(-1), dim=1)


def child(mode: str, n: int, queries: int, classes: int, slice_size: int) -> dict:
    torch.set_num_threads(THREADS)
    levels, cert, labels = make_data(n, classes)
    head = make_head()
    qids = np.arange(queries)
    before = reset_peak()
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        if mode == "harness":
            fields = {"levels": levels, "certainty": cert}
            scorer = make_pair_scorer(head, fields)
            inner = lambda qi, gi: scorer(qids[qi], gi)  # noqa: E731
            k = int(np.bincount(labels).max())  # max R + 1 (what MAP@R reads), self handled below
            chunks = pair_chunks(n)

            def masked(qi, gi):
                s = inner(qi, gi)
                return s.masked_fill(
                    torch.as_tensor(gi)[None, :] == torch.as_tensor(qids[qi])[:, None], -torch.inf
                )

            lists = np.concatenate(
                [
                    idx
                    for _, _, idx in exhaustive_knn(
                        queries, n, masked, k, query_chunk=chunks[0], reference_chunk=chunks[1]
                    )
                ]
            )
        else:
            keep = int(np.bincount(labels).max())
            lists = []
            for a in range(0, queries, slice_size):
                order = code_style(
                    head, levels[a : a + slice_size], cert[a : a + slice_size], levels, cert
                ).numpy()
                lists += [row[row != a + q][:keep] for q, row in enumerate(order)]
            lists = np.stack(lists)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    working = (_status_kib("VmHWM") - before) / 1024
    return {
        "mode": mode,
        "pairs": queries * n,
        "wall_s": wall,
        "cpu_s": cpu,
        "pairs_per_s": queries * n / wall,
        "working_mib": working,
        "slice": slice_size if mode == "code" else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "first": lists[:, 0].tolist(),
    }


def rerank_gap(n: int, queries: int, classes: int, ks=(100, 1000)) -> dict:
    torch.set_num_threads(THREADS)
    levels, cert, labels = make_data(n, classes)
    head = make_head()
    qids = np.arange(queries)
    r = relevant_counts(labels[qids], labels, same_source=True)
    out = {}
    with torch.inference_mode():
        full = torch.cat(
            [
                -head.score_pairs(
                    {"levels": levels[a : a + 8], "certainty": cert[a : a + 8]},
                    {"levels": levels, "certainty": cert},
                )
                for a in range(0, queries, 8)
            ]
        )
        full[qids, qids] = torch.inf
        exhaustive = (
            torch.sort(full, dim=1, stable=True).indices[:, :-1].numpy()
        )  # ascending d^, self last
        cos = levels[:queries, -1] @ levels[:, -1].t()
        cos[qids, qids] = -torch.inf
        cos_order = torch.sort(cos, dim=1, descending=True, stable=True).indices[:, :-1].numpy()

        def score(lists):
            m = retrieval_metrics(
                labels[lists],
                labels[qids],
                r,
                metrics=["precision_at_1", "mean_average_precision_at_r"],
            )
            return {"P@1": m["precision_at_1"], "MAP@R": m["mean_average_precision_at_r"]}

        out["exhaustive"] = score(exhaustive)
        out["cosine"] = score(cos_order)
        for k in ks:
            head_ids = cos_order[:, :k]
            d = np.take_along_axis(full.numpy(), head_ids, 1)
            reranked = np.take_along_axis(head_ids, np.argsort(d, 1, kind="stable"), 1)
            out[f"rerank_{k}"] = score(np.concatenate([reranked, cos_order[:, k:]], 1))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=5924)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument(
        "--slice", type=int, default=256, help="queries per slice of the released code's approach"
    )
    parser.add_argument("--json", default="")
    parser.add_argument("--child", default="")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.images, args.queries, args.classes, args.slice)))
        return {}
    results = {}
    for mode in ("harness", "code"):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--images",
            str(args.images),
            "--queries",
            str(args.queries),
            "--classes",
            str(args.classes),
            "--slice",
            str(args.slice),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        res = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            .stdout.strip()
            .splitlines()[-1]
        )
        results[mode] = res
        total = args.images * args.images / res["pairs_per_s"]
        print(
            f"{mode:8s} {res['pairs']:,} pairs in {res['wall_s']:.1f} s wall ({res['cpu_s']:.1f} s CPU): "
            f"{res['pairs_per_s']:,.0f} pairs/s (whole {args.images}^2 set ~{total / 60:.1f} min); "
            f"ranking memory {res['working_mib']:,.0f} MiB (process peak {res['peak_rss_mib']:,.0f} MiB)"
        )
    harness, code = results["harness"], results["code"]
    whole = code["working_mib"] * args.images / min(args.slice, args.queries)
    print(
        f"memory: harness / code slice of {min(args.slice, args.queries)} = "
        f"{harness['working_mib'] / code['working_mib']:.3f}; the code's whole-matrix ranking (one slice of "
        f"{args.images}) would need ~{whole / 1024:,.0f} GiB (linear in the slice), harness / whole = "
        f"{harness['working_mib'] / whole:.5f}"
    )
    print(f"time: harness / code = {code['pairs_per_s'] / harness['pairs_per_s']:.2f}")
    same = np.mean(np.array(results["harness"]["first"]) == np.array(results["code"]["first"]))
    print(f"same first result: {same:.3f}")
    gap = rerank_gap(args.images, args.queries, args.classes)
    for name, m in gap.items():
        print(f"{name:12s} P@1 {m['P@1']:.4f}  MAP@R {m['MAP@R']:.4f}")
    out = {
        "args": vars(args),
        "code_whole_matrix_mib": whole,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "first"} for k, v in results.items()},
        "same_first": float(same),
        "rerank_gap": gap,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
