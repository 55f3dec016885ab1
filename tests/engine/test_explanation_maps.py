"""Each method's map path on hand-built inputs whose right map is known: a map of the
differing part reaches the ceiling through every method's own aggregation (A-grouping,
G-grouping, DIABLO, AVSL, DIML, SAM) and the shared scoring path; AVSL's and DIABLO's
maps of hand-built activations put their mass on the part (where Eq. 5's min-shifted CAMs
and the energy shares stand flat); a figure draws the scored map up to scale; the
uniform-on-object map scores the within-object chance; a map that keeps its score with
the model re-drawn fails the training check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness.components.explanation.maps import grouped_pair_maps, offset_removed
from harness.components.explanation.sanity import ground_truth_maps, uniform_on_object_maps
from harness.components.explanation.scores import within_object_scores
from harness.engine.explain.maps import PairMaps, Pairs, scored_maps
from harness.engine.explain.parts import part_scores
from harness.engine.explain.sanity import sanity_verdicts, trained_parts_stage
from harness.methods import HeadOutput
from harness.methods.avsl_figures import rectified_cams
from harness.methods.diablo import attended_energy
from harness.reports.explanations import overlay_heat
from tests.methods.test_conformance import build

SIZE, GRID, PART = 64, 8, 2
PARTS = ["body", "head"]


def labels() -> torch.Tensor:
    """A 64 x 64 image: the object on cells 1-6 of the 8 x 8 grid, the differing part
    (label 2) on rows 2-3, columns 4-5 of it (one cell of a 4 x 4 grid), the rest of the
    object label 1."""
    out = torch.zeros(SIZE, SIZE, dtype=torch.long)
    out[8:56, 8:56] = 1
    out[16:32, 32:48] = PART
    return out


def part_map(grid: int, transpose: bool = False) -> torch.Tensor:
    """The hand-made map: the part's mask averaged onto a ``grid`` x ``grid`` map."""
    mask = (labels() == PART).float()
    mask = mask.T if transpose else mask
    return F.adaptive_avg_pool2d(mask[None, None], grid)[0, 0]


def scores(query: torch.Tensor, gallery: torch.Tensor) -> dict[str, np.ndarray]:
    """The part scores of P pair maps at feature resolution, through the scoring path."""
    p = len(query)
    lab = labels().expand(p, SIZE, SIZE)
    pairs = Pairs(np.arange(p), np.arange(p), np.zeros(p, bool), np.full(p, PART), "near-miss")
    maps = PairMaps(scored_maps(query, SIZE), scored_maps(gallery, SIZE))
    return part_scores(maps, lab, lab, pairs, PARTS)


def ceiling(grid: int = GRID) -> dict[str, np.ndarray]:
    """The scores of the part's mask blurred to one cell of a ``grid`` x ``grid`` map."""
    lab = labels()[None].expand(2, SIZE, SIZE)
    gt = ground_truth_maps(lab, torch.full((2,), PART), SIZE / grid)
    pairs = Pairs(np.arange(2), np.arange(2), np.zeros(2, bool), np.full(2, PART), "near-miss")
    return part_scores(PairMaps(gt, gt), lab, lab, pairs, PARTS)


def unit(*shape: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


# ------------------------------------------------------------ each method's own path


def grouped_path(name: str, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A-grouping / G-grouping / DIABLO: every group's (entry's) map is the part map."""
    head = build(name).head
    maps = grid.expand(2, 4, *grid.shape).clone()
    field = {"extras": {"gate_maps": maps}} if name == "ggrouping" else {"attention": maps}
    q = HeadOutput(embedding=unit(2, 32, seed=0), groups=unit(2, 4, 8, seed=1), **field)
    g = HeadOutput(embedding=unit(2, 32, seed=2), groups=unit(2, 4, 8, seed=3), **field)
    out = head.pair_maps(q, g, torch.tensor([False, True]))
    assert out is not None
    return out


def avsl_path(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AVSL: every node's CAM at every level is the part map (Eq. 11's weights then only
    scale it)."""
    head = build("avsl").head
    r = head.project[0].out_features

    def output(seed: int) -> HeadOutput:
        levels = [unit(2, r, seed=seed + k) for k in range(head.num_levels)]
        cams = [grid.expand(2, r, *grid.shape).clone() for _ in levels]
        certainty = torch.rand(2, head.num_levels, r, generator=torch.Generator().manual_seed(seed))
        return HeadOutput(
            embedding=levels[-1], levels=levels, cams=cams, extras={"certainty": certainty}
        )

    out = head.pair_maps(output(0), output(10), torch.tensor([False, True]))
    assert out is not None
    return out


def diml_path(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DIML: the part's cells carry the direction of the partner's embedding, the others
    an orthogonal one, so the cross-correlation marginals (Eq. 6) and the plan sit on the
    part's cells."""
    head = build("diml").head
    g = head.grid
    cells = F.adaptive_avg_pool2d(grid[None, None], g)[0, 0].flatten() > 0.5
    u, v = torch.eye(32)[0], torch.eye(32)[1]
    local = torch.where(cells[:, None], u, v).expand(2, g * g, 32).clone()
    out = HeadOutput(embedding=u.expand(2, 32).clone(), local=local)
    maps = head.pair_maps(out, out, torch.tensor([True, True]))
    assert maps is not None
    return maps


def object_map(grid: int) -> torch.Tensor:
    """The rest of the object (not the part) averaged onto a ``grid`` x ``grid`` map."""
    rest = (labels() == 1).float()
    return F.adaptive_avg_pool2d(rest[None, None], grid)[0, 0]


def sam_path(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SAM (Eq. 1 in closed form): a head whose projection reads channel k into dimension
    k, a map whose channel 0 is the part and channel 1 the rest of the object. For a
    same-class pair (w = 1 - |f_q - f_g| = 1) the gradient of s = w . f raises the smaller
    of the two embedding coordinates, the part's (it covers less of the map), and lowers
    the larger: the rectified map is the part."""
    head = build("sam").head
    with torch.no_grad():
        head.project.weight.copy_(torch.eye(*head.project.weight.shape))
        head.project.bias.zero_()
    fmap = torch.zeros(2, head.project.in_features, *grid.shape)
    fmap[:, 0], fmap[:, 1] = grid, object_map(grid.shape[-1])
    out = HeadOutput(embedding=unit(2, 32, seed=6), extras={"map": fmap})
    maps = head.pair_maps(out, out, torch.tensor([True, True]))
    assert maps is not None
    return maps


PATHS = {
    "agrouping": lambda grid: grouped_path("agrouping", grid),
    "ggrouping": lambda grid: grouped_path("ggrouping", grid),
    "diablo": lambda grid: grouped_path("diablo", grid),
    "avsl": avsl_path,
    "diml": diml_path,
    "sam": sam_path,
}


@pytest.mark.parametrize("method", sorted(PATHS))
def test_a_map_of_the_part_reaches_the_ceiling_through_the_methods_path(method):
    maps = PATHS[method](part_map(GRID))
    top, got = ceiling(maps[0].shape[-1]), scores(*maps)
    assert (got["within_object_pointing"] == 1).all() and (got["pointing_game"] == 1).all()
    share, best = got["discriminative_part_share"].mean(), top["discriminative_part_share"].mean()
    assert share >= 0.9 * best, (share, best)
    within, best = got["within_object_share"].mean(), top["within_object_share"].mean()
    assert within >= 0.9 * best, (within, best)


def test_the_same_map_transposed_falls_far_below_the_ceiling():
    """The scoring path reads the map's orientation: transposing H and W moves the mass."""
    right = scores(*grouped_path("agrouping", part_map(GRID)))["discriminative_part_share"]
    wrong = scores(*grouped_path("agrouping", part_map(GRID, transpose=True)))
    assert wrong["discriminative_part_share"].mean() < 0.5 * right.mean()
    assert (wrong["pointing_game"] == 0).all()


# ------------------------------------------------------------ hand-built activations


def test_avsl_map_of_cams_with_a_positive_part_and_negative_rest_sits_on_the_part():
    """Every node's CAM is +1 on the part, small negative values elsewhere and one deep
    negative value (the max-pool term of the code's CAM with a negative weight), as a
    node whose evidence is the part: the rectified CAMs put the map on the part; Eq. 5's
    min-shifted ones give every cell its distance to that minimum, and the map spreads."""
    gen = torch.Generator().manual_seed(4)
    on_part = part_map(GRID) > 0.5
    noise = -0.1 * torch.rand(2, 48, GRID, GRID, generator=gen)
    noise[:, :, 7, 0] = -5.0
    cams = torch.where(on_part, torch.ones_like(noise), noise)
    weights = torch.rand(2, 48, generator=gen)
    rectified = torch.einsum("pr,prk->pk", weights, rectified_cams(cams)).view(2, GRID, GRID)
    nodes = cams.flatten(2)
    min_shifted = F.normalize(nodes - nodes.amin(-1, keepdim=True), p=1, dim=-1)  # Eq. 5
    shifted = torch.einsum("pr,prk->pk", weights, min_shifted).view(2, GRID, GRID)
    good, flat = scores(rectified, rectified), scores(shifted, shifted)
    best = ceiling()["within_object_share"].mean()
    assert good["within_object_share"].min() >= 0.9 * best
    assert flat["within_object_share"].max() < 0.5 * best


def test_diablo_map_of_features_strong_on_the_part_sits_on_the_part():
    """Features strong on the part, attention split evenly between the entries: the
    attended energy puts each entry's map, and the pair map, on the part; each entry's
    share of the energy is the same everywhere."""
    strong = part_map(GRID) > 0.5
    features = torch.where(strong, 3.0, 0.1).expand(2, 16, GRID, GRID).clone()
    attention = torch.full((2, 4, 16, GRID, GRID), 0.25)
    energy = attended_energy(features, attention)
    groups = unit(2, 4, 8, seed=5)
    q, g = grouped_pair_maps(energy, energy, groups, groups, torch.tensor([True, False]))
    best = ceiling()["within_object_share"].mean()
    assert scores(q, g)["within_object_share"].min() >= 0.9 * best
    share = energy / features.pow(2).sum(1)[:, None]
    assert torch.allclose(share, torch.full_like(share, 0.25**2))


# ------------------------------------------------------------ one map, scored and drawn


def test_a_figure_draws_the_scored_map_up_to_scale():
    """A map with a constant offset: scored with the offset removed, and the figure's
    min-max scaling of that map is the same map over its maximum."""
    raw = 5.0 + part_map(GRID)[None].expand(1, GRID, GRID)
    scored = scored_maps(raw, SIZE)[0]
    assert scored.min() == 0
    drawn = overlay_heat(scored, (SIZE, SIZE))
    torch.testing.assert_close(drawn, scored / scored.max())
    # The offset no longer dilutes the share: the map scores as the part map does.
    plain = scores(part_map(GRID)[None], part_map(GRID)[None])["discriminative_part_share"]
    got = scores(raw, raw)["discriminative_part_share"]
    np.testing.assert_allclose(got, plain, rtol=1e-6)


def test_offset_removal_keeps_a_non_negative_map_and_cuts_negative_values():
    maps = torch.tensor([[[2.0, 3.0], [2.0, 6.0]], [[-1.0, 1.0], [0.5, -2.0]]])
    torch.testing.assert_close(
        offset_removed(maps), torch.tensor([[[0.0, 1.0], [0.0, 4.0]], [[0.0, 1.0], [0.5, 0.0]]])
    )


# ------------------------------------------------------------ chance and the training check


def test_the_uniform_on_object_map_scores_the_within_object_chance_and_no_hit():
    lab = labels()[None]
    scored = within_object_scores(uniform_on_object_maps(lab), lab, torch.tensor([PART]))
    torch.testing.assert_close(scored["share"], scored["chance"])
    assert float(scored["chance"]) == pytest.approx(16 * 16 / (48 * 48))
    assert float(scored["pointing"]) == 0.0


def test_a_map_with_no_mass_on_the_object_scores_chance_within_it():
    lab = labels()[None]
    outside = (lab == 0).double()
    scored = within_object_scores(outside, lab, torch.tensor([PART]))
    torch.testing.assert_close(scored["share"], scored["chance"])
    assert float(scored["pointing"]) == 0.0


def test_the_training_check_fails_a_map_that_keeps_its_score_with_the_model_redrawn():
    gen = np.random.default_rng(0)
    chance = np.full(50, 0.1)
    learned = 0.3 + 0.02 * gen.standard_normal(50)
    checks = {
        "randomised head (method)": {"within_object_share": learned.copy()},
        "randomised s32 (method)": {"within_object_share": 0.1 + 0.02 * gen.standard_normal(50)},
        # the model-free map: the same score at every step
        "randomised head (baseline)": {"within_object_share": learned.copy()},
        "randomised s32 (baseline)": {"within_object_share": learned.copy()},
    }
    sources = {
        name: {"within_object_share": learned, "within_object_chance": chance}
        for name in ("method", "baseline")
    }
    verdicts = sanity_verdicts(sources, checks, lr_backbone=1e-4)
    assert verdicts["method"]["uses_training"] is True
    assert verdicts["method"]["trained_parts_randomised"] == "randomised s32 (method)"
    assert verdicts["baseline"]["uses_training"] is False
    assert verdicts["method"]["beats_chance"] is True
    # A frozen backbone: only the head is trained, and the head's step decides.
    frozen = sanity_verdicts(sources, checks, lr_backbone=0.0)
    assert frozen["method"]["uses_training"] is False
    assert trained_parts_stage(0.0, ["head", "s32"]) == "head"


def test_a_map_at_its_chance_does_not_beat_it():
    chance = np.full(40, 0.1)
    at_chance = chance + 0.01 * np.random.default_rng(1).standard_normal(40)
    verdicts = sanity_verdicts(
        {"method": {"within_object_share": at_chance, "within_object_chance": chance}},
        {},
        lr_backbone=1e-4,
    )
    assert verdicts["method"]["beats_chance"] is False
    assert verdicts["method"]["uses_training"] is None
