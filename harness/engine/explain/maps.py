"""The run, pairs and maps of ``python -m harness explain`` (:mod:`harness.engine.explain.explain_run`):
a finished run rebuilt from the store, the pairs of test images to explain (near-miss or
nearest-neighbour), the images and part masks of test indices, and each pair's maps (the
method's own and the similarity Grad-CAM baseline) with the pair's embeddings."""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from harness.base.errors import HarnessError
from harness.components.data.own import register_path
from harness.components.data.synthetic import load_part_mask
from harness.components.data.transforms import build_transform, normalize_batch
from harness.components.explanation.maps import offset_removed, upsample_maps
from harness.config.protocol import protocol_from_dict
from harness.engine.run.data import prepare_splits, recorded_control
from harness.engine.run.model import build_model
from harness.engine.run.runtime import resolve_device
from harness.methods import METHODS, PairExplainer
from harness.store.environment import default_checkpoint_root
from harness.store.location import tracking_uri
from harness.store.queries import find_run, read_artifact
from harness.store.weights import load_finished_weights

__all__ = [
    "RunContext",
    "Pairs",
    "PairMaps",
    "load_run",
    "near_miss_class_pairs",
    "near_miss_pairs",
    "neighbour_pairs",
    "load_images",
    "to_pictures",
    "part_labels",
    "similarity_gradcam",
    "output_rows",
    "compute_maps",
    "scored_maps",
]


# ------------------------------------------------------------------------ the run


@dataclass
class RunContext:
    """A finished run rebuilt from the store: its model (selected weights), protocol and
    splits (checked against the split digest it recorded)."""

    run_id: str
    method: str
    dataset: str
    protocol: Any
    splits: Any
    model: Any
    device: torch.device
    tags: dict[str, str]


def _finished_run(run_id: str):

    run = find_run(run_id)
    if run is None:
        raise HarnessError(
            f"explain: no run '{run_id}' in the tracking store {tracking_uri()} "
            f"(give a run id from the MLflow UI or a run --json record's mlflow_run_id)"
        )
    if run.info.status != "FINISHED":
        raise HarnessError(
            f"explain: run '{run_id}' is {run.info.status}, not FINISHED: it has no selected weights"
        )
    missing = [t for t in ("method", "dataset", "seed") if t not in run.data.tags]
    if missing:
        raise HarnessError(
            f"explain: run '{run_id}' is not a harness training run (no {', '.join(missing)} tag)"
        )
    return run


def _run_protocol(run_id: str):

    try:
        data = read_artifact(
            run_id,
            "protocol/resolved.json",
            lambda path: json.loads(path.read_text(encoding="utf-8")),
        )
        if data is None:
            raise FileNotFoundError("protocol/resolved.json")
    except Exception as err:
        raise HarnessError(
            f"explain: run '{run_id}' has no readable protocol/resolved.json artifact "
            f"({type(err).__name__})"
        ) from None
    return protocol_from_dict(data)


def _own_dataset(run_id: str, tags: dict[str, str], path: Path | None) -> None:
    """A run on a dataset given by its path: that dataset registered again under the run's
    name, read from ``path`` (``explain --dataset``, when the files moved) or from where the
    run found it. ``path`` for a run on a built-in dataset is an error."""

    recorded = tags.get("dataset_path", "")
    if path is None and not recorded:
        return
    if not recorded:
        raise HarnessError(
            f"explain: run '{run_id}' is on the built-in dataset '{tags['dataset']}'; "
            f"--dataset names the files of a run on a dataset given by its path"
        )
    where = Path(path) if path is not None else Path(recorded)
    if not where.exists():
        raise HarnessError(
            f"explain: dataset {where} of run '{run_id}' does not exist"
            + ("" if path is not None else "; give where its files are now with --dataset PATH")
        )
    register_path(where, tags["dataset"])


def load_run(
    run_id: str,
    *,
    data_root: Path | None = None,
    checkpoint_root: Path | None = None,
    device: str = "auto",
    dataset_path: Path | None = None,
) -> RunContext:
    """Rebuild a finished run: protocol from its ``protocol/resolved.json``, splits (the
    digest must match the recorded one; a dataset given by its path is read from
    ``dataset_path``, else from where the run read it), model with its selected weights
    (as ``run --evaluate-only --init-from`` does)."""

    run = _finished_run(run_id)
    tags = run.data.tags
    protocol = _run_protocol(run_id)
    method, dataset = tags["method"], tags["dataset"]

    if method not in METHODS:
        raise HarnessError(
            f"explain: run '{run_id}' is of method '{method}', which this code does not register"
        )
    _own_dataset(run_id, tags, dataset_path)
    # A control run (run --seen-class-control, --shuffled-labels-control) trained on other
    # training splits; its digest is of those.
    control = recorded_control(tags.get("deviations", ""))
    splits = prepare_splits(protocol, dataset, data_root, control=control, seed=int(tags["seed"]))
    recorded = tags.get("split_digest", "")
    if recorded and splits.digest() != recorded:
        where = "--dataset" if "dataset_path" in tags else "--data-root"
        raise HarnessError(
            f"explain: the {dataset} splits found now (digest {splits.digest()}) are not the ones run "
            f"'{run_id}' was tested on ({recorded}); point {where} at that dataset"
        )
    model = build_model(protocol, method, dict(protocol.methods.get(method, {})))
    load_finished_weights(
        model, run_id, flag="explain", checkpoint_root=checkpoint_root or default_checkpoint_root()
    )
    dev = resolve_device(device)
    # Channels-last as in training and evaluation: same numbers up to rounding, and the
    # thousands of forward passes of the deletion / insertion curves run 30-40% faster on
    # CPU (oneDNN's depthwise convolutions) and use cuDNN's tensor-core kernels on GPU.
    model = model.to(dev, memory_format=torch.channels_last).eval()  # type: ignore[call-overload]  # torch's stubs lack Module.to(device, memory_format=...), which it accepts
    return RunContext(run_id, method, dataset, protocol, splits, model, dev, dict(tags))


# ------------------------------------------------------------------------ pairs


def near_miss_class_pairs(classes: dict[int, dict], parts: list[str]) -> list[tuple[int, int, int]]:
    """``(class a, class b, part label)`` for every two classes whose attributes differ in
    exactly one part (the label is the part's index + 1, as in the part masks)."""
    ids = sorted(classes)
    out = []
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            differ = [p for p in parts if classes[a][p] != classes[b][p]]
            if len(differ) == 1:
                out.append((a, b, parts.index(differ[0]) + 1))
    return out


@dataclass
class Pairs:
    query: np.ndarray  # P test indices
    gallery: np.ndarray  # P test indices
    same: np.ndarray  # P bools
    region: np.ndarray  # P part labels that differ (0: none known)
    kind: str


def near_miss_pairs(ctx: RunContext, count: int, rng: np.random.Generator) -> Pairs | None:
    root = ctx.splits.extras.get("root")
    manifest = Path(root) / "manifest.json" if root else None
    if manifest is None or not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    labels = ctx.splits.test.labels
    present = set(np.unique(labels).tolist())
    classes = {c: spec for c, spec in enumerate(data.get("classes", [])) if c in present}
    candidates = near_miss_class_pairs(classes, list(data["parts"]))
    if not candidates:
        return None
    by_class = {c: np.flatnonzero(labels == c) for c in present}
    order = rng.permutation(len(candidates))
    q, g, region = [], [], []
    for k in range(count):
        a, b, part = candidates[order[k % len(candidates)]]
        if rng.random() < 0.5:
            a, b = b, a
        q.append(rng.choice(by_class[a]))
        g.append(rng.choice(by_class[b]))
        region.append(part)
    return Pairs(
        np.array(q), np.array(g), np.zeros(count, dtype=bool), np.array(region), "near-miss"
    )


def neighbour_pairs(ctx: RunContext, count: int, rng: np.random.Generator, batch: int) -> Pairs:
    test = ctx.splits.test
    emb = torch.cat(
        [
            _forward(
                ctx, load_images(ctx, np.arange(i, min(i + batch, len(test))))
            ).embedding.float()
            for i in range(0, len(test), batch)
        ]
    )
    queries = rng.choice(len(test), size=count, replace=count > len(test))
    sims = emb[torch.as_tensor(queries)] @ emb.T
    sims[torch.arange(count), torch.as_tensor(queries)] = -float("inf")
    gallery = sims.argmax(1).numpy()
    same = test.labels[queries] == test.labels[gallery]
    return Pairs(queries, gallery, same, np.zeros(count, dtype=np.int64), "nearest-neighbour")


# ------------------------------------------------------------------------ images and maps


def load_images(ctx: RunContext, indices: np.ndarray) -> torch.Tensor:

    transform = build_transform(ctx.protocol.image, train=False)
    stack = torch.stack([transform(ctx.splits.test.read(int(i))) for i in indices])
    return normalize_batch(stack.to(ctx.device), ctx.protocol.image).contiguous(
        memory_format=torch.channels_last
    )


def to_pictures(ctx: RunContext, images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(ctx.protocol.image.mean, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(ctx.protocol.image.std, device=images.device).view(1, 3, 1, 1)
    return (images * std + mean).clamp(0, 1).cpu()


def part_labels(ctx: RunContext, indices: np.ndarray) -> torch.Tensor | None:
    """The part masks of test images, resized (and cropped) as the protocol's eval transform
    shapes the images (nearest)."""
    masks = ctx.splits.extras.get("masks")
    if not masks:
        return None

    spec, keys = ctx.protocol.image, ctx.splits.test.keys()
    out = []
    for i in indices:
        mask = torch.from_numpy(
            load_part_mask(ctx.splits.extras["root"], masks[keys[int(i)]]).copy()
        )[None]
        if spec.eval_transform == "resize":  # as build_transform's eval transforms
            shaped = TF.resize(
                mask, [spec.size, spec.size], interpolation=InterpolationMode.NEAREST
            )
        else:
            shaped = TF.center_crop(
                TF.resize(mask, spec.resize, interpolation=InterpolationMode.NEAREST), spec.size
            )
        out.append(shaped[0])
    return torch.stack(out)


def _forward(ctx: RunContext, images: torch.Tensor):
    with torch.no_grad():
        return ctx.model(images)


def similarity_gradcam(
    model, query_images: torch.Tensor, gallery_images: torch.Tensor, same: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Grad-CAM of the pair's target score (cosine for a same-class pair, minus the cosine
    otherwise) on the last feature map the backbone hands to the head: alpha_k = spatial
    mean of dt/dA_k, map = ReLU(sum_k alpha_k A_k) (Selvaraju et al. 2017, Eqs. 1-2). Each
    image's map is taken with its partner's embedding held fixed (an image's map depends
    only on its own pair). Rows must not interact (eval mode).

    Returns the two P x h x w maps and the head's output for the 2P images (queries first,
    detached), so that the method's own maps need no second forward pass."""
    n = len(query_images)
    with torch.no_grad():
        maps = [m.detach() for m in model.backbone(torch.cat([query_images, gallery_images]))]
    with torch.enable_grad():
        last = maps[-1].float().requires_grad_()
        out = model.head([*maps[:-1], last.to(maps[-1].dtype)])
        e = out.embedding.float()
        cos = (e[:n] * e[n:]).sum(-1)
        target = torch.where(torch.as_tensor(same, device=cos.device), cos, -cos)
        (grad,) = torch.autograd.grad(target.sum(), last)
    cam = F.relu((grad.mean((2, 3), keepdim=True) * last.detach()).sum(1))
    return cam[:n], cam[n:], _detached(out)


def _detached(out):
    """A head output with every tensor (also in lists and ``extras``) detached."""
    return _map_tensors(out, lambda x: x.detach())


def output_rows(out, rows: slice):
    """The head output of the images ``rows`` (tensors, lists of tensors, ``extras``)."""
    return _map_tensors(out, lambda x: x[rows])


def _map_tensors(out, fn):
    """``out`` (a head output) with ``fn`` applied to every tensor, also inside lists,
    tuples and ``extras``."""

    def apply(value):
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, list | tuple):
            return type(value)(apply(v) for v in value)
        if isinstance(value, dict):
            return {k: apply(v) for k, v in value.items()}
        return value

    return type(out)(**{k: apply(v) for k, v in vars(out).items()})


def scored_maps(maps: torch.Tensor, size: int) -> torch.Tensor:
    """P x h x w maps at feature resolution as they are scored and drawn: resized to the
    image (bilinear), negative values cut and the constant offset removed
    (:func:`~harness.components.explanation.maps.offset_removed`), P x size x size."""
    up = upsample_maps(maps.float()[:, None], (size, size), normalize=False)[:, 0]
    return offset_removed(up)


@dataclass
class PairMaps:
    query: torch.Tensor  # P x H x W at image size
    gallery: torch.Tensor


def compute_maps(
    ctx: RunContext, pairs: Pairs, batch: int
) -> tuple[PairMaps | None, PairMaps, torch.Tensor, torch.Tensor]:
    """The method's own and the baseline's maps of every pair, at image size (CPU), and
    the query and gallery embeddings (P x D), all from one forward pass per batch."""
    size = ctx.protocol.image.size
    own_q, own_g, base_q, base_g, emb_q, emb_g = [], [], [], [], [], []
    head = ctx.model.head
    has_own = isinstance(head, PairExplainer)
    for start in range(0, len(pairs.query), batch):
        rows = slice(start, start + batch)
        q, g = load_images(ctx, pairs.query[rows]), load_images(ctx, pairs.gallery[rows])
        same = torch.as_tensor(pairs.same[rows], device=ctx.device)
        bq, bg, out = similarity_gradcam(ctx.model, q, g, same)
        base_q.append(scored_maps(bq, size).cpu())
        base_g.append(scored_maps(bg, size).cpu())
        emb_q.append(out.embedding[: len(q)].float())
        emb_g.append(out.embedding[len(q) :].float())
        if has_own:
            with torch.no_grad():
                own = typing.cast(PairExplainer, head).pair_maps(
                    output_rows(out, slice(0, len(q))), output_rows(out, slice(len(q), None)), same
                )
            if own is None:
                has_own = False
            else:
                own_q.append(scored_maps(own[0], size).cpu())
                own_g.append(scored_maps(own[1], size).cpu())
    method = PairMaps(torch.cat(own_q), torch.cat(own_g)) if has_own else None
    return (
        method,
        PairMaps(torch.cat(base_q), torch.cat(base_g)),
        torch.cat(emb_q),
        torch.cat(emb_g),
    )
