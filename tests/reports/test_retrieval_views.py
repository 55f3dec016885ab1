"""The retrieval examples and the embedding map a run logs: which queries are chosen (the
worst, the best, seeded random ones, never twice), their cosine neighbours, the frames the
figure draws around them, the map's sample, and the files rendered together."""

from __future__ import annotations

import io
import json

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import same_color

from harness.components.data import ArrayImageSet
from harness.config.sections import ImageSpec
from harness.reports.figures import (
    CORRECT_COLOUR,
    EXAMPLES_DATA,
    EXAMPLES_FIGURE,
    MAP_DATA,
    MAP_FIGURE,
    QUERY_COLOUR,
    WRONG_COLOUR,
    RetrievalExample,
    ViewData,
    draw_embedding_map,
    draw_retrieval_examples,
    frame_colours,
    group_sizes,
    map_sample,
    retrieval_examples,
    select_queries,
    top_neighbours,
    views_files,
)


def test_the_examples_are_a_third_worst_a_third_best_and_a_third_random():
    assert group_sizes(6) == (2, 2, 2)
    assert group_sizes(4) == (2, 1, 1)
    assert group_sizes(5) == (2, 2, 1)
    assert group_sizes(1) == (1, 0, 0)
    assert group_sizes(0) == (0, 0, 0)


def test_select_queries_takes_the_worst_then_the_best_then_seeded_random_ones():
    rng = np.random.default_rng(3)
    values = rng.permutation(np.linspace(0.0, 1.0, 40))
    values[[5, 17]] = np.nan  # queries with no other item of their class
    chosen = select_queries(values, 6, seed=0)
    indices = [i for i, _ in chosen]
    assert [g for _, g in chosen] == ["worst", "worst", "best", "best", "random", "random"]
    assert len(set(indices)) == 6 and not {5, 17} & set(indices)
    order = np.argsort(np.where(np.isnan(values), np.inf, values))
    assert indices[:2] == list(order[:2])  # the lowest two, lowest first
    assert indices[2:4] == list(np.argsort(np.where(np.isnan(values), np.inf, -values))[:2])
    assert indices[4] < indices[5]  # the random ones in index order
    assert select_queries(values, 6, seed=0) == chosen  # seeded
    others = {tuple(i for i, _ in select_queries(values, 6, seed=s)[4:]) for s in range(5)}
    assert len(others) > 1  # the seed decides the random ones, not the worst or the best
    assert {tuple(i for i, _ in select_queries(values, 6, seed=s)[:4]) for s in range(5)} == {
        tuple(indices[:4])
    }


def test_select_queries_breaks_ties_by_index_and_never_repeats_a_query():
    values = np.array([0.5, 0.0, 0.5, 0.0, 1.0, 1.0, 0.5])
    chosen = select_queries(values, 6, seed=1)
    assert [i for i, _ in chosen][:4] == [1, 3, 4, 5]
    assert len({i for i, _ in chosen}) == len(chosen) == 6


def test_a_small_test_set_gives_fewer_queries_than_asked():
    values = np.array([0.2, np.nan, 0.9, 0.4, np.nan])
    chosen = select_queries(values, 6, seed=0)
    assert sorted(i for i, _ in chosen) == [0, 2, 3]
    assert [g for _, g in chosen] == ["worst", "worst", "best"]
    assert select_queries(np.full(4, np.nan), 6, seed=0) == []
    assert select_queries(values, 0, seed=0) == []


def test_top_neighbours_rank_by_cosine_without_the_query_itself():
    angles = np.array([0.0, 0.1, 0.3, 1.0, 2.2, 3.0])
    embeddings = np.stack([np.cos(angles), np.sin(angles)], 1).astype(np.float32) * 5
    found = top_neighbours(embeddings, None, [0, 3], k=3)
    assert found.tolist() == [[1, 2, 3], [2, 1, 0]]
    # Against a gallery nothing is removed; a short gallery gives fewer neighbours.
    gallery = embeddings[[5, 1, 0]]
    assert top_neighbours(embeddings, gallery, [0], k=5).tolist() == [[2, 1, 0]]


def _example(label: int, neighbour_labels: tuple[int, ...], group: str = "worst"):
    return RetrievalExample(
        query=0,
        group=group,
        value=0.25,
        label=label,
        neighbours=tuple(range(1, len(neighbour_labels) + 1)),
        neighbour_labels=neighbour_labels,
    )


def test_the_figure_frames_same_class_neighbours_green_and_others_red():
    examples = [_example(3, (3, 1, 3)), _example(7, (2, 2, 7), "best")]
    assert frame_colours(examples[0]) == [CORRECT_COLOUR, WRONG_COLOUR, CORRECT_COLOUR]
    pictures = [[np.full((8, 8, 3), v, np.uint8) for v in (0, 60, 120, 180)]] * 2
    figure = draw_retrieval_examples(examples, pictures, caption="a run")
    axes = figure.axes
    assert len(axes) == 2 * 4
    expected = [
        [QUERY_COLOUR, CORRECT_COLOUR, WRONG_COLOUR, CORRECT_COLOUR],
        [QUERY_COLOUR, WRONG_COLOUR, WRONG_COLOUR, CORRECT_COLOUR],
    ]
    for row, colours in enumerate(expected):
        for col, colour in enumerate(colours):
            spines = axes[row * 4 + col].spines.values()
            assert all(same_color(s.get_edgecolor(), colour) for s in spines), (row, col)
    assert "worst: AP@R 0.25, class 3" in axes[0].get_title(loc="left")
    assert "best: AP@R 0.25, class 7" in axes[4].get_title(loc="left")
    assert figure.get_suptitle() == "a run"


def test_the_map_sample_keeps_the_queries_and_is_seeded():
    assert map_sample(30, [3], seed=0, limit=50).tolist() == list(range(30))
    sample = map_sample(1000, [7, 999], seed=4, limit=100)
    assert len(sample) == 100 and {7, 999} <= set(sample.tolist())
    assert (np.diff(sample) > 0).all()
    assert (map_sample(1000, [7, 999], seed=4, limit=100) == sample).all()
    assert (map_sample(1000, [7, 999], seed=5, limit=100) != sample).any()


def test_the_map_marks_the_classes_of_the_example_queries():
    rng = np.random.default_rng(0)
    points, labels = rng.normal(size=(40, 2)), np.repeat(np.arange(8), 5)
    figure = draw_embedding_map(points, labels, [(0, 1), (12, 2)], caption="map")
    legend = figure.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["class 0", "class 2"]
    stars = [c for c in figure.axes[0].collections if len(c.get_offsets()) == 1]
    assert len(stars) == 2
    assert [t.get_text() for t in figure.axes[0].texts] == ["1", "2"]


@pytest.fixture
def views() -> ViewData:
    """30 test images of 5 classes, their embeddings near their class's direction (one
    class far from its own), each query's AP@R made up."""
    rng = np.random.default_rng(2)
    labels = np.repeat(np.arange(5), 6)
    images = ArrayImageSet(rng.integers(0, 256, (30, 40, 40, 3), dtype=np.uint8), labels)
    centres = rng.normal(size=(5, 8))
    embeddings = (centres[labels] + 0.3 * rng.normal(size=(30, 8))).astype(np.float32)
    values = rng.random(30)
    return ViewData(embeddings, images, values, ImageSpec(size=32, resize=36), 6, 0, "a run")


def test_the_views_render_both_figures_with_the_data_they_draw(views, tmp_path):
    files = views_files(views, tmp_path)
    assert set(files) == {
        tmp_path / n for n in (EXAMPLES_FIGURE, EXAMPLES_DATA, MAP_FIGURE, MAP_DATA)
    }
    assert bytes(files[tmp_path / EXAMPLES_FIGURE]).startswith(b"\x89PNG")
    rows = json.loads(files[tmp_path / EXAMPLES_DATA])
    examples = retrieval_examples(views)
    assert rows == [e.record() for e in examples] and len(rows) == 6
    labels = views.images.labels
    for row in rows:
        assert row["query"] not in row["neighbours"] and len(row["neighbours"]) == 5
        assert row["neighbour_labels"] == [int(labels[i]) for i in row["neighbours"]]
        assert row["correct"] == [lab == row["label"] for lab in row["neighbour_labels"]]
        assert row["ap_at_r"] == pytest.approx(views.values[row["query"]])
    points = pd.read_csv(io.StringIO(files[tmp_path / MAP_DATA]))
    assert points["index"].tolist() == list(range(30))
    heads = points[points["example_row"] > 0].sort_values("example_row")
    assert heads["index"].tolist() == [r["query"] for r in rows]
    assert np.isfinite(points[["x", "y"]].to_numpy()).all()
    # The same run draws the same map.
    assert views_files(views, tmp_path)[tmp_path / MAP_DATA] == files[tmp_path / MAP_DATA]


def test_no_examples_when_no_query_has_a_value_and_no_map_of_a_few_points(views, tmp_path):
    empty = ViewData(
        views.embeddings[:3],
        views.images.subset(np.arange(3)),
        np.full(3, np.nan),
        views.image_spec,
        6,
        0,
    )
    assert views_files(empty, tmp_path) == {}


def test_a_split_with_a_gallery_draws_its_neighbours_from_the_gallery(views, tmp_path):
    rng = np.random.default_rng(5)
    gallery_labels = np.repeat(np.arange(5), 3) + 100  # classes the queries do not have
    gallery = ArrayImageSet(rng.integers(0, 256, (15, 40, 40, 3), dtype=np.uint8), gallery_labels)
    with_gallery = ViewData(
        views.embeddings,
        views.images,
        views.values,
        views.image_spec,
        3,
        0,
        gallery=rng.normal(size=(15, 8)).astype(np.float32),
        gallery_images=gallery,
    )
    rows = json.loads(views_files(with_gallery, tmp_path)[tmp_path / EXAMPLES_DATA])
    assert len(rows) == 3
    for row in rows:
        assert all(0 <= i < 15 for i in row["neighbours"])
        assert row["neighbour_labels"] == [int(gallery_labels[i]) for i in row["neighbours"]]
        assert row["correct"] == [False] * 5
