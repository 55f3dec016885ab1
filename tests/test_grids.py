"""Grid files: DIABLO Table 1's rows (a method with one loss only, through ``[[extra]]``)
and ``[published] rows`` (the published rows beside each reproduced method)."""

from __future__ import annotations

import pytest

from harness.errors import HarnessError
from harness.grids import load_grid


def _rows(grid) -> set[tuple[str, str]]:
    return {(c.loss, c.method) for c in grid.cells}


@pytest.mark.parametrize("smoke", [False, True])
def test_diablo_table1_has_the_rows_of_table_1(smoke):
    grid = load_grid("diablo-table1", smoke=smoke)
    losses = ("contrastive", "triplet", "binomial_deviance")
    assert _rows(grid) == {(lo, m) for lo in losses for m in ("plain", "diablo")} | {("binomial_deviance",
                                                                                     "diablo_n16")}
    assert grid.published_file == "results/published/diablo.csv" and grid.published_tables == ("1",)
    assert grid.published_rows["diablo_n16"] == ("diablo@entries=16",)
    if smoke:  # one seed, one epoch of two batches: 7 cells
        assert len(grid.cells) == 7 and grid.experiment == "diablo-table1-smoke"
        assert {c.protocol.name for c in grid.cells} == {"diablo-smoke"}
        assert {(c.dataset, c.backbone, c.seed) for c in grid.cells} == {("synthetic", "efficientnet_lite0", 0)}
        assert all({"schedule.epochs", "sampling.batches_per_epoch"} <= {d.field for d in c.deviations}
                   for c in grid.cells)
        assert {c.protocol.schedule.epochs for c in grid.cells} == {1}
    else:  # 7 rows x 2 datasets x 3 seeds, the paper's protocol, no deviation
        assert len(grid.cells) == 42 and {c.dataset for c in grid.cells} == {"cub200", "cars196"}
        assert {c.protocol.name for c in grid.cells} == {"diablo"} and not any(c.deviations for c in grid.cells)


def _grid(tmp_path, rows: str) -> str:
    path = tmp_path / "g.toml"
    path.write_text('protocol = "smoke"\nmethods = ["plain"]\nlosses = ["margin"]\nbackbones = ["resnet18"]\n'
                    'datasets = ["synthetic"]\nseeds = [0]\n[[extra]]\nmethods = ["diablo"]\n'
                    f'[published]\nfile = "x.csv"\ntables = [1]\n{rows}')
    return str(path)


def test_published_rows_name_methods_of_the_grid(tmp_path):
    grid = load_grid(_grid(tmp_path, '[published.rows]\nplain = ["plain@"]\ndiablo = ["diablo@entries=8"]\n'))
    assert grid.published_rows == {"plain": ("plain@",), "diablo": ("diablo@entries=8",)}
    assert load_grid(_grid(tmp_path, "")).published_rows == {}
    with pytest.raises(HarnessError, match="'published.rows.diablo_n8': 'diablo_n8' is not a method of the grid"):
        load_grid(_grid(tmp_path, '[published.rows]\ndiablo_n8 = ["diablo@entries=8"]\n'))
    with pytest.raises(HarnessError, match="'published.rows.plain' must be a non-empty list of str"):
        load_grid(_grid(tmp_path, '[published.rows]\nplain = "plain@"\n'))
    with pytest.raises(HarnessError, match="unknown grid key 'published.row'"):
        load_grid(_grid(tmp_path, '[published.row]\nplain = ["plain@"]\n'))
