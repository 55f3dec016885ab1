"""The sanity checks' pieces (harness.components.explanation.sanity): the ground-truth map
is the ceiling (it points at its part), the random map the floor (it scores chance), the
rank correlation reads an unchanged map as 1 and a reshuffled one as about 0, and the
cascading randomisation re-initialises every tensor of a stage, top layers first, the same
way from the same seed."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from harness.components.explanation.sanity import (
    ground_truth_maps,
    random_maps,
    randomisation_stages,
    randomise_,
    rank_correlation,
    uniform_maps,
)
from harness.components.explanation.scores import mean_interval, region_scores


def _creature_parts(count: int, size: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` label maps with a part 1 (an ellipse of 5-12 px radii) at random places
    and a larger part 2 beside it, as the synthetic creatures' parts are; region 1."""
    gen = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    labels = np.zeros((count, size, size), dtype=np.int64)
    for i in range(count):
        cy, cx = gen.integers(15, size - 15, 2)
        ry, rx = gen.integers(5, 13, 2)
        labels[i][((yy - cy) / (ry + 12)) ** 2 + ((xx - cx) / (rx + 12)) ** 2 <= 1] = 2
        labels[i][((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1] = 1
    return torch.as_tensor(labels), torch.ones(count, dtype=torch.long)


def test_the_ground_truth_map_points_at_its_part_and_beats_chance():
    labels, region = _creature_parts(50)
    for grid in (3, 6, 12):
        maps = ground_truth_maps(labels, region, cell=96 / grid)
        scores = region_scores(maps, labels, region)
        assert float(scores["pointing"].mean()) >= 0.9
        assert float(scores["share"].mean()) > 3 * float(scores["chance"].mean())
    # A finer grid is a sharper ceiling.
    coarse = region_scores(ground_truth_maps(labels, region, cell=32), labels, region)
    fine = region_scores(ground_truth_maps(labels, region, cell=8), labels, region)
    assert float(fine["share"].mean()) > float(coarse["share"].mean())


def test_the_floors_score_chance_and_the_flat_one_never_points():
    labels, region = _creature_parts(200, seed=1)
    chance = region_scores(uniform_maps(tuple(labels.shape)), labels, region)
    assert float(chance["pointing"].sum()) == 0.0
    assert torch.allclose(chance["share"], chance["chance"])
    drawn = random_maps(tuple(labels.shape), 6, torch.Generator().manual_seed(0))
    scores = region_scores(drawn, labels, region)
    mean, lo, hi = mean_interval(scores["share"].numpy())
    chance_mean = float(scores["chance"].mean())
    assert lo <= chance_mean <= hi, (mean, lo, hi, chance_mean)


def test_random_maps_are_as_smooth_as_their_grid_and_follow_the_seed():
    a = random_maps((2, 48, 48), 4, torch.Generator().manual_seed(3))
    b = random_maps((2, 48, 48), 4, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    # Neighbouring pixels of a 4 x 4 grid upsampled to 48 px differ by little.
    assert float((a[:, :, 1:] - a[:, :, :-1]).abs().max()) < 0.2


def test_rank_correlation_reads_a_kept_ranking_as_one_and_a_lost_one_as_zero():
    gen = torch.Generator().manual_seed(0)
    maps = torch.rand((30, 16, 16), generator=gen)
    assert torch.allclose(rank_correlation(maps, maps * 3 + 1), torch.ones(30, dtype=torch.float64))
    assert torch.allclose(rank_correlation(maps, -maps), -torch.ones(30, dtype=torch.float64))
    shuffled = maps.flatten(1)[:, torch.randperm(256, generator=gen)].view_as(maps)
    assert abs(float(rank_correlation(maps, shuffled).mean())) < 0.05
    flat = torch.zeros_like(maps)
    assert torch.equal(rank_correlation(maps, flat), torch.zeros(30, dtype=torch.float64))
    assert torch.equal(rank_correlation(flat, flat), torch.ones(30, dtype=torch.float64))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)
        )
        self.head = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.full((1,), 16.0))  # a learned scale, no initialiser


def test_the_cascade_goes_top_first_and_skips_points_without_parameters():
    net = _Net()
    points = [("s8", 4, ("0", "1")), ("s16", 4, ()), ("s32", 4, ("2", "3"))]
    stages = randomisation_stages(net.head, net.body, points)
    assert [name for name, _ in stages] == ["head", "s32", "s8"]
    assert stages[1][1] == [net.body[2], net.body[3]]


def test_randomise_reinitialises_every_tensor_of_a_stage_the_same_way_from_a_seed():
    nets = [_Net(), _Net()]
    for net in nets:
        with torch.no_grad():
            for p in net.parameters():
                p.fill_(0.5)  # "trained" values
            net.body[1].running_mean.fill_(3.0)
        count = randomise_([net.body, net], torch.Generator().manual_seed(7))
        assert count == len(list(net.parameters()))
        for name, p in net.named_parameters():
            assert not torch.all(p == 0.5), name
        assert torch.equal(net.body[1].running_mean, torch.zeros(4))
    for (name, a), b in zip(nets[0].named_parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a, b), name
    # The scale without an initialiser is drawn at the trained tensor's spread (or 1).
    assert float(nets[0].scale.detach()) != 16.0
