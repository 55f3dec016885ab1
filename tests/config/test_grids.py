"""Grid files: DIABLO Table 1's rows (a method with one loss only, through ``[[extra]]``)
and ``[published] rows`` (the published rows beside each reproduced method)."""

from __future__ import annotations

import pytest

from harness.base.errors import HarnessError
from harness.config.grids import load_grid


def _rows(grid) -> set[tuple[str, str]]:
    return {(c.loss, c.method) for c in grid.cells}


@pytest.mark.parametrize("smoke", [False, True])
def test_diablo_table1_has_the_rows_of_table_1(smoke):
    grid = load_grid("diablo-table1", smoke=smoke)
    losses = ("contrastive", "triplet", "binomial_deviance")
    assert _rows(grid) == {(lo, m) for lo in losses for m in ("plain", "diablo")} | {
        ("binomial_deviance", "diablo_n16")
    }
    assert grid.published_file == "results/published/diablo.csv" and grid.published_tables == ("1",)
    assert grid.published_rows["diablo_n16"] == ("diablo@entries=16",)
    if smoke:  # two seeds (an interval per cell), one epoch of two batches: 14 cells
        assert len(grid.cells) == 14 and grid.experiment == "diablo-table1-smoke"
        assert {c.protocol.name for c in grid.cells} == {"diablo-smoke"}
        assert {(c.dataset, c.backbone, c.seed) for c in grid.cells} == {
            ("synthetic", "efficientnet_lite0", s) for s in (0, 1)
        }
        # one epoch is diablo-smoke's own; two batches of it are the grid's deviation
        assert all(
            {d.field for d in c.deviations} & {"sampling.batches_per_epoch", "schedule.epochs"}
            == {"sampling.batches_per_epoch"}
            for c in grid.cells
        )
        assert {c.protocol.schedule.epochs for c in grid.cells} == {1}
    else:  # 7 rows x 2 datasets x 3 seeds, the paper's protocol, no deviation
        assert len(grid.cells) == 42 and {c.dataset for c in grid.cells} == {"cub200", "cars196"}
        assert {c.protocol.name for c in grid.cells} == {"diablo"} and not any(
            c.deviations for c in grid.cells
        )


def _grid(tmp_path, rows: str) -> str:
    path = tmp_path / "g.toml"
    path.write_text(
        'protocol = "smoke"\nmethods = ["plain"]\nlosses = ["margin"]\nbackbones = ["resnet18"]\n'
        'datasets = ["synthetic"]\nseeds = [0]\n[[extra]]\nmethods = ["diablo"]\n'
        f'[published]\nfile = "x.csv"\ntables = [1]\n{rows}'
    )
    return str(path)


def test_published_rows_name_methods_of_the_grid(tmp_path):
    grid = load_grid(
        _grid(tmp_path, '[published.rows]\nplain = ["plain@"]\ndiablo = ["diablo@entries=8"]\n')
    )
    assert grid.published_rows == {"plain": ("plain@",), "diablo": ("diablo@entries=8",)}
    assert load_grid(_grid(tmp_path, "")).published_rows == {}
    with pytest.raises(
        HarnessError, match="'published.rows.diablo_n8': 'diablo_n8' is not a method of the grid"
    ):
        load_grid(_grid(tmp_path, '[published.rows]\ndiablo_n8 = ["diablo@entries=8"]\n'))
    with pytest.raises(
        HarnessError,
        match="grid key 'published.rows.plain' = \"plain@\": expected a non-empty list of strings",
    ):
        load_grid(_grid(tmp_path, '[published.rows]\nplain = "plain@"\n'))
    with pytest.raises(HarnessError, match="unknown grid key 'published.row'"):
        load_grid(_grid(tmp_path, '[published.row]\nplain = ["plain@"]\n'))


@pytest.mark.parametrize("smoke", [False, True])
def test_avsl_table1_has_margin_and_proxy_anchor_with_and_without_avsl(smoke):
    grid = load_grid("avsl-table1", smoke=smoke)
    assert _rows(grid) == {(lo, m) for lo in ("margin", "proxy_anchor") for m in ("plain", "avsl")}
    if smoke:  # 4 rows, two seeds, on synthetic
        assert len(grid.cells) == 8 and {c.dataset for c in grid.cells} == {"synthetic"}
    else:  # 4 rows x 3 datasets x 3 seeds under the paper's protocol, with its per-dataset code settings
        assert len(grid.cells) == 36 and not any(c.deviations for c in grid.cells)
        weights = {
            c.dataset: c.protocol.for_dataset(c.dataset).methods["avsl"]["level_weights"]
            for c in grid.cells
            if c.method == "avsl"
        }
        assert weights == {
            "cub200": [0.5, 1.0, 0.5],
            "cars196": [1.0, 4.0, 4.0],
            "sop": [1.0, 4.0, 4.0],
        }


@pytest.mark.parametrize("smoke", [False, True])
def test_sam_table1_pairs_each_architecture_with_its_loss(smoke):
    grid = load_grid("sam-table1", smoke=smoke)
    assert _rows(grid) == {
        ("contrastive", "plain"),
        ("contrastive", "sam_siamese"),
        ("triplet", "plain"),
        ("triplet", "sam"),
        ("quadruplet", "plain"),
        ("quadruplet", "sam_quadruplet"),
    }
    assert len(grid.cells) == (12 if smoke else 18)
    if not smoke:  # every loss of Table 1 is sanctioned by the sam protocol: no deviation
        assert not any(c.deviations for c in grid.cells)


@pytest.mark.parametrize(
    "name", ["agrouping-table3", "diml-table1", "diablo-table1", "avsl-table1", "sam-table1"]
)
def test_every_published_row_a_grid_names_is_in_its_csv(name):
    """A row spec that matches nothing would drop a published column from the table."""
    from harness.reports.tables import load_published

    grid = load_grid(name)
    frame = load_published(grid.published_file, grid.published_tables, grid.published_rows or None)
    assert not frame.empty
    if grid.published_rows:
        assert set(frame["method"]) == set(grid.published_rows)
