"""The reference maps and the model randomisation that every explanation score is checked
against before methods are compared (Adebayo et al., "Sanity Checks for Saliency Maps",
NeurIPS 2018).

* :func:`ground_truth_maps`: the ceiling, the differing part's mask blurred to the scale
  of one cell of the model's feature map (a map the model could draw at best);
* :func:`uniform_maps` and :func:`random_maps`: the floors, a flat map (its part share is
  the part's area share, chance; it never wins the pointing game) and random values on the
  model's grid, upsampled as the model's maps are;
* :func:`uniform_on_object_maps`: the objectness reference, a map flat on the object and
  zero elsewhere: it knows where the object is and nothing about its parts, so its share
  within the object is that score's chance, while its share of the image is several times
  the part's;
* :func:`randomisation_stages` and :func:`randomise_`: Adebayo's cascading model
  randomisation (Sec. 3.1), the trained weights re-initialised top layers first (the
  head, then the backbone's points from the last to the first), so a map can be drawn at
  each depth of destruction;
* :func:`rank_correlation`: the per-image Spearman rank correlation between two maps, the
  similarity Adebayo et al. report between a map of the trained model and one of the
  randomised model (Sec. 3.1, Fig. 4). A map whose ranks survive the destruction of the
  model says nothing about the model.

Pure functions over tensors and modules; :mod:`harness.engine.explain.sanity` runs them
on a finished run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from harness.components.explanation.scores import gaussian_kernel

__all__ = [
    "ground_truth_maps",
    "uniform_maps",
    "uniform_on_object_maps",
    "random_maps",
    "rank_correlation",
    "randomisation_stages",
    "randomise_",
    "UNCHANGED_CORRELATION",
]

#: A map passes the randomisation check when the 95% interval of its mean rank correlation
#: with the fully randomised model's map lies below this: less than half of its ranking
#: survives the model's destruction (Adebayo et al. read a rank correlation near 1 as an
#: unchanged map, Guided Backprop's, and near 0 as a changed one, the plain gradient's and
#: Grad-CAM's). A map that stays above it, or whose interval straddles it, is flagged.
UNCHANGED_CORRELATION = 0.5


def ground_truth_maps(labels: torch.Tensor, region: torch.Tensor, cell: float) -> torch.Tensor:
    """The ceiling: each image's region (``labels == region[i]``, N x H x W part labels)
    blurred by a Gaussian of standard deviation half a map cell (``cell``: the image's
    size over the feature map's), zero-padded. Its maximum lies on the region for any
    region wider than a few pixels, so it wins the pointing game; its part share falls
    short of 1 by the mass the blur spreads past the region's edge."""
    inside = (labels.long() == region.long().view(-1, 1, 1)).double()[:, None]
    kernel = gaussian_kernel(max(cell / 2, 0.5))
    pad = len(kernel) // 2
    rows = F.conv2d(inside, kernel.view(1, 1, -1, 1), padding=(pad, 0))
    blurred = F.conv2d(rows, kernel.view(1, 1, 1, -1), padding=(0, pad))[:, 0]
    return blurred.clamp_min(0)


def uniform_maps(shape: tuple[int, int, int]) -> torch.Tensor:
    """The flat floor: N x H x W ones."""
    return torch.ones(shape, dtype=torch.float64)


def uniform_on_object_maps(labels: torch.Tensor) -> torch.Tensor:
    """The objectness reference: N x H x W, 1 on the object (``labels > 0``), 0 elsewhere."""
    return (labels.long() > 0).double()


def random_maps(
    shape: tuple[int, int, int], grid: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The random floor: N x ``grid`` x ``grid`` uniform values upsampled bilinearly to
    N x H x W, as smooth as a model's map on that grid."""
    n, h, w = shape
    coarse = torch.rand((n, 1, grid, grid), generator=generator, dtype=torch.float64)
    return F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[:, 0]


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image, the Spearman rank correlation of two N x H x W maps (ties take their
    mean rank), in [-1, 1]. A flat map ranks nothing: against a map that ranks its pixels
    it keeps none of the ranking (0), and two flat maps agree (1)."""
    if a.shape != b.shape:
        raise ValueError(f"maps must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    ra = torch.as_tensor(stats.rankdata(a.flatten(1).double().numpy(), axis=1))
    rb = torch.as_tensor(stats.rankdata(b.flatten(1).double().numpy(), axis=1))
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    na, nb = ra.norm(dim=1), rb.norm(dim=1)
    both_flat = (na == 0) & (nb == 0)
    correlation = (ra * rb).sum(1) / (na * nb).clamp_min(1e-300)
    return torch.where(both_flat, 1.0, correlation.clamp(-1, 1))


def randomisation_stages(
    head: nn.Module, body: nn.Module, points: Sequence[tuple[str, int, Sequence[str]]]
) -> list[tuple[str, list[nn.Module]]]:
    """The cascade's layers, top first: ``("head", [head])``, then each point of the
    backbone from the last to the first with the modules that compute it (``points``: a
    backbone spec's ``(point, channels, module paths)``; ``body``: the network they name)."""
    stages: list[tuple[str, list[nn.Module]]] = [("head", [head])]
    for point, _, paths in reversed(list(points)):
        modules = [body.get_submodule(path) for path in paths]
        if any(True for m in modules for _ in m.parameters()):
            stages.append((point, modules))
    return stages


def randomise_(modules: Sequence[nn.Module], generator: torch.Generator) -> int:
    """Re-initialise in place every parameter and BatchNorm statistic of ``modules``: each
    layer with its own initialiser (``reset_parameters``) under a seed drawn from
    ``generator``, and a parameter no layer re-initialises with normal draws of the trained
    tensor's standard deviation (learned scales such as A-grouping's). Returns the number
    of tensors re-initialised."""
    touched: set[int] = set()
    for module in modules:
        for layer in module.modules():
            reset = getattr(layer, "reset_parameters", None)
            own = list(layer.parameters(recurse=False))
            if callable(reset) and own:
                seed = int(torch.randint(2**62, (1,), generator=generator))
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    reset()
                touched.update(id(p) for p in own)
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                layer.reset_running_stats()
        for param in module.parameters():
            if id(param) in touched:
                continue
            with torch.no_grad():
                scale = float(param.detach().double().std()) if param.numel() > 1 else 1.0
                draw = torch.randn(param.shape, generator=generator, dtype=torch.float64)
                param.copy_(draw * (scale if math.isfinite(scale) and scale > 0 else 1.0))
            touched.add(id(param))
    return len(touched)
