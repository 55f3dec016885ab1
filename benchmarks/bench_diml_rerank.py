"""Benchmark of DIML's batched re-ranking (``harness.methods.diml``) on 2 CPU threads, or on a GPU
(``--device cuda``: both pipelines on the GPU, the harness's with its GPU-sized working set).

Workload: 10,000 images searched against themselves (SOP-style), each query's top
K = 100 re-ranked at G = 4, D = 128, from last-layer feature maps (2048 x 7 x 7,
non-negative like ResNet-50's layer4: an object bump of class-specific channels on a
noisy background, 5 images per class) to the final order.

Measured in one process, same data:

(a) the harness: ``DIMLHead`` embeds every map (GAP + Linear, ROI Align to 4 x 4 +
    Linear per cell), faiss finds each query's top 100 by cosine, and
    ``rerank_top_k`` re-orders them by ``DIMLHead.rerank_similarity`` (all pairs
    batched); pairs per second over all three steps and for the re-ranking alone;
(b) a reimplementation (in our own words) of the released code's test loop
    (wl-zhao/DIML ``evaluation/eval_diml.py`` + ``utilities/diml.py``): the Linear at
    every location, bilinear upsampling to 16 x 16 and 4 x 4 average pooling, then per
    query in Python: cosine against the whole gallery, argsort, the top 100's
    similarity matrices, cross-correlation marginals (normalised by sum + 1e-5), its
    scaling-domain Sinkhorn (stop when the mean change of the row scaling < 0.1, at most
    100 iterations, one ``.item()`` per iteration) and the final argsort. The loop runs
    on ``--reference-queries`` queries and is extrapolated; its embedding step is timed
    on all images.

Targets: (a) at least as many pairs per second as (b), and >= 20,000 pairs/s (SOP's
60,502 x 100 pairs in under 5 minutes) on the CPU; on an H100-class GPU >= 1,000,000
pairs/s in the re-ranking step. The machine may be shared: timings are
wall-clock and noisy, so CPU seconds and the Sinkhorn iteration counts (which do not
depend on load) are reported too. Also reported: how much the harness's default
Sinkhorn tolerance (L1 marginal error 1e-4) changes the final order against a tight
solve (1e-8, up to 2,000 iterations) on the reference queries, and how often the two
pipelines agree on the first result (they differ by design: converged vs the code's
stopping rule, ROI Align vs upsampling, delta-smoothed vs sum + 1e-5 marginals).

Usage: ``python benchmarks/bench_diml_rerank.py [--queries 10000] [--reference-queries 500] [--device cuda]
[--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

THREADS = 2
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
# On a shared machine OpenMP's default spin-waiting at every parallel region's barrier
# turns oversubscription into a ~10x slowdown of both pipelines; passive waiting costs
# nothing measurable on an idle machine. Set the variable yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.components.evaluation import knn, rerank_top_k  # noqa: E402
from harness.components.transport import sinkhorn  # noqa: E402
from harness.engine.run.embedding import make_reranker  # noqa: E402
from harness.methods import create_method  # noqa: E402

CHANNELS, SIZE, DIM, GRID, K = 2048, 7, 128, 4, 100
PER_CLASS = 5
EPS = 0.05


# --------------------------------------------------------------------------- data


def feature_maps(start: int, stop: int, seed: int) -> torch.Tensor:
    """Maps of images start..stop-1 (deterministic per image): relu(noise + bump * class code)."""
    out = torch.empty(stop - start, CHANNELS, SIZE, SIZE)
    ys, xs = torch.meshgrid(
        torch.arange(SIZE, dtype=torch.float32),
        torch.arange(SIZE, dtype=torch.float32),
        indexing="ij",
    )
    for row, i in enumerate(range(start, stop)):
        cls = torch.Generator().manual_seed(seed * 1_000_003 + i // PER_CLASS)
        code = torch.relu(torch.randn(CHANNELS, generator=cls)) * (
            torch.rand(CHANNELS, generator=cls) < 0.25
        )
        img = torch.Generator().manual_seed(seed * 7_919 + 10_000_019 + i)
        cy, cx = (torch.rand(2, generator=img) * (SIZE - 3) + 1.5).tolist()
        width = 1.0 + 1.5 * float(torch.rand(1, generator=img))
        bump = torch.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / (2 * width**2))
        noise = 0.6 * torch.randn(CHANNELS, SIZE, SIZE, generator=img)
        out[row] = torch.relu(noise + 2.0 * bump * code[:, None, None])
    return out


# ------------------------------------------------------------------ (a) the harness


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def harness_pipeline(head, num: int, seed: int, batch: int, device: torch.device) -> dict:
    gen_s = head_s = 0.0
    embs, locs = [], []
    with torch.inference_mode():
        for start in range(0, num, batch):
            t = time.perf_counter()
            maps = feature_maps(start, min(num, start + batch), seed).to(device)
            _sync(device)
            gen_s += time.perf_counter() - t
            t = time.perf_counter()
            out = head([maps])
            embs.append(out.embedding)
            locs.append(out.local)
            _sync(device)
            head_s += time.perf_counter() - t
    emb, local = torch.cat(embs), torch.cat(locs)
    t = time.perf_counter()
    idx, _ = knn(emb.cpu().numpy(), None, K, use_gpu=device.type == "cuda")
    knn_s = time.perf_counter() - t
    fields = {"embedding": emb, "local": local}
    reranker = make_reranker(head, fields, device=device)
    t, cpu = time.perf_counter(), time.process_time()
    order = rerank_top_k(idx, np.arange(num), reranker, K)
    rerank_s, rerank_cpu = time.perf_counter() - t, time.process_time() - cpu
    # Iteration statistics on the first 100 queries (not timed).
    with torch.inference_mode():
        q = torch.arange(min(100, num), device=device)
        c = torch.as_tensor(idx[: len(q), :K], device=device)
        s = torch.einsum("qid,qkjd->qkij", local[q], local[c]).reshape(-1, GRID * GRID, GRID * GRID)
        gq = F.relu(torch.einsum("qid,qkd->qki", local[q], emb[c])).reshape(-1, GRID * GRID) + 1e-5
        gc = F.relu(torch.einsum("qkjd,qd->qkj", local[c], emb[q])).reshape(-1, GRID * GRID) + 1e-5
        _, its = sinkhorn(
            1 - s,
            gq / gq.sum(-1, keepdim=True),
            gc / gc.sum(-1, keepdim=True),
            eps=EPS,
            max_iter=head.max_iter,
            tol=head.tol,
            return_iterations=True,
        )
        iterations = its.float()
    return {
        "emb": emb,
        "local": local,
        "knn": idx,
        "order": order,
        "generate_s": gen_s,
        "head_s": head_s,
        "knn_s": knn_s,
        "rerank_s": rerank_s,
        "rerank_cpu_s": rerank_cpu,
        "sinkhorn_iterations": {
            "mean": float(iterations.mean()),
            "median": float(iterations.median()),
            "p99": float(torch.quantile(iterations, 0.99)),
            "at_cap": float((iterations >= head.max_iter).float().mean()),
        },
    }


# --------------------------------------------------- (b) the released code's loop, restated


def reference_embed(
    head, num: int, seed: int, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per location Linear, upsample to 4G (bilinear, corners aligned), G x G average pool,
    L2-normalise; global = the normalised GAP + Linear embedding."""
    bank, centres, spent = [], [], 0.0
    with torch.inference_mode():
        for start in range(0, num, batch):
            maps = feature_maps(start, min(num, start + batch), seed).to(device)
            _sync(device)
            t = time.perf_counter()
            centres.append(F.normalize(head.project(maps.mean((2, 3))), dim=-1))
            per_point = head.project(maps.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            per_point = F.interpolate(
                per_point, size=(4 * GRID, 4 * GRID), mode="bilinear", align_corners=True
            )
            per_point = F.adaptive_avg_pool2d(per_point, GRID)
            bank.append(F.normalize(per_point.flatten(2), dim=1))  # B x D x G*G
            _sync(device)
            spent += time.perf_counter() - t
    return torch.cat(bank), torch.cat(centres), spent


def reference_sinkhorn(kernel, u, v):
    r, c = torch.ones_like(u), torch.ones_like(v)
    iterations = 0
    for _ in range(100):
        r_old = r
        r = u / torch.matmul(kernel, c[:, :, None])[..., 0]
        c = v / torch.matmul(kernel.transpose(1, 2), r[:, :, None])[..., 0]
        iterations += 1
        if (r - r_old).abs().mean().item() < 0.1:
            break
    return r[:, :, None] * kernel * c[:, None, :], iterations


def reference_loop(
    bank: torch.Tensor, centres: torch.Tensor, queries: int
) -> tuple[np.ndarray, float, list[int]]:
    orders, counts = [], []
    t, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for q in range(queries):
            centre = centres[q]
            approx = centres @ centre
            approx[q] = -100
            ranked = torch.argsort(approx, descending=True)
            top = ranked[:K]
            anchor, cands = bank[q], bank[top]  # D x R, K x D x R
            sim = torch.einsum("dm,kds->ksm", anchor, cands)  # rows: candidate cells
            kernel = torch.exp(-(1.0 - sim) / EPS)
            att = F.relu(torch.einsum("d,kdr->kr", centre, cands))
            u = att / (att.sum(1, keepdim=True) + 1e-5)
            att = F.relu(torch.einsum("dr,kd->kr", anchor, centres[top]))
            v = att / (att.sum(1, keepdim=True) + 1e-5)
            plan, its = reference_sinkhorn(kernel, u, v)
            structural = (plan * sim).sum((1, 2))
            inside = torch.argsort(structural + approx[top], descending=True)
            orders.append(torch.cat([top[inside], ranked[K:]])[:K].cpu().numpy())
            counts.append(its)
    return np.stack(orders), time.perf_counter() - t, time.process_time() - cpu, counts


# ---------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--reference-queries", type=int, default=500)
    parser.add_argument("--batch", type=int, default=250, help="images per embedding batch")
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from harness.engine.run.runtime import resolve_device

    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    try:
        import faiss

        faiss.omp_set_num_threads(args.threads)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(args.seed)
    head = (
        create_method(
            "diml", channels={"s32": CHANNELS}, embedding_size=DIM, grid=GRID, rerank_k=K, eps=EPS
        )
        .eval()
        .to(device)
    )
    pairs = args.queries * K

    a = harness_pipeline(head, args.queries, args.seed, args.batch, device)
    total_a = a["head_s"] + a["knn_s"] + a["rerank_s"]
    bank, centres, ref_embed_s = reference_embed(head, args.queries, args.seed, args.batch, device)
    nref = min(args.reference_queries, args.queries)
    ref_orders, ref_loop_s, ref_loop_cpu, ref_counts = reference_loop(bank, centres, nref)
    ref_loop_full = ref_loop_s * args.queries / nref
    total_b = ref_embed_s + ref_loop_full

    ours = a["order"][:nref, :K]
    tight = (
        create_method(
            "diml",
            channels={"s32": CHANNELS},
            embedding_size=DIM,
            grid=GRID,
            rerank_k=K,
            eps=EPS,
            tol=1e-8,
            max_iter=2000,
        )
        .eval()
        .to(device)
    )
    tight.load_state_dict(head.state_dict())
    fields = {"embedding": a["emb"], "local": a["local"]}
    ids = np.arange(nref)
    loose_scores = make_reranker(head, fields)(ids, a["knn"][:nref, :K])
    tight_scores = make_reranker(tight, fields)(ids, a["knn"][:nref, :K])
    tight_order = rerank_top_k(a["knn"][:nref], ids, make_reranker(tight, fields), K)[:, :K]
    tolerance = {
        "max_abs_score_difference": float(np.abs(loose_scores - tight_scores).max()),
        "queries_with_identical_top_k_order": float((tight_order == ours).all(1).mean()),
    }
    agreement = {
        "top1": float((ours[:, 0] == ref_orders[:, 0]).mean()),
        "top10_overlap": float(
            np.mean(
                [len(set(x[:10]) & set(y[:10])) / 10 for x, y in zip(ours, ref_orders, strict=True)]
            )
        ),
        "cosine_top1_unchanged_by_harness": float((ours[:, 0] == a["knn"][:nref, 0]).mean()),
    }
    result = {
        "device": str(device),
        "threads": args.threads,
        "queries": args.queries,
        "k": K,
        "grid": GRID,
        "dim": DIM,
        "pairs": pairs,
        "harness": {
            "embed_s": a["head_s"],
            "knn_s": a["knn_s"],
            "rerank_s": a["rerank_s"],
            "total_s": total_a,
            "pairs_per_s_total": pairs / total_a,
            "pairs_per_s_rerank": pairs / a["rerank_s"],
            "rerank_cpu_s": a["rerank_cpu_s"],
            "pairs_per_cpu_s_rerank": pairs / a["rerank_cpu_s"],
            "tol": head.tol,
            "max_iter": head.max_iter,
            "sinkhorn_iterations": a["sinkhorn_iterations"],
        },
        "reference": {
            "embed_s": ref_embed_s,
            "loop_s_measured": ref_loop_s,
            "loop_queries": nref,
            "loop_s_extrapolated": ref_loop_full,
            "total_s": total_b,
            "pairs_per_s_total": pairs / total_b,
            "pairs_per_s_loop": pairs / ref_loop_full,
            "loop_cpu_s_measured": ref_loop_cpu,
            "pairs_per_cpu_s_loop": nref * K / ref_loop_cpu,
            "sinkhorn_iterations_mean": float(np.mean(ref_counts)),
        },
        "speedup_total": total_b / total_a,
        "agreement_on_reference_queries": agreement,
        "tolerance_check": tolerance,
        "sop_minutes_at_harness_rate": 60_502 * K / (pairs / total_a) / 60,
        "targets": {
            "not_slower_than_reference": total_a <= total_b,
            "at_least_20k_pairs_per_s": pairs / total_a >= 20_000,
        },
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
