"""Explanation scores (harness.components.explanation.scores), the explain command and its table:
planted maps against ground truth, deletion against a random order on a model whose
similarity depends on one part only, error lines, and one end-to-end explain."""

from __future__ import annotations

import dataclasses
import json
import math

import mlflow
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from torchvision.transforms import InterpolationMode

from harness.base.metric_keys import metric_key
from harness.cli.main import main
from harness.components.data.synthetic import load_part_mask, load_synthetic
from harness.components.explanation.scores import (
    blurred_canvas,
    curve_auc,
    mean_interval,
    part_shares,
    perturbation_curves,
    perturbation_masks,
    region_scores,
)
from harness.config.protocol_files import load_protocol
from harness.engine.explain.maps import (
    RunContext,
    load_images,
    near_miss_class_pairs,
    output_rows,
    part_labels,
    similarity_gradcam,
)
from harness.methods import PairExplainer, list_methods


def _labels() -> torch.Tensor:
    """Two 8 x 8 label maps: background 0, part 1 a 2 x 2 square, part 2 a 2 x 4 bar."""
    labels = torch.zeros(2, 8, 8, dtype=torch.long)
    labels[:, 1:3, 1:3] = 1
    labels[:, 5:7, 2:6] = 2
    return labels


def test_a_map_exactly_on_the_differing_part_scores_pointing_game_1_and_share_1():
    labels = _labels()
    region = torch.tensor([1, 2])
    planted = (labels == region.view(-1, 1, 1)).double()
    scores = region_scores(planted, labels, region)
    assert scores["pointing"].tolist() == [1.0, 1.0]
    assert scores["share"].tolist() == [1.0, 1.0]
    assert scores["chance"].tolist() == pytest.approx([4 / 64, 8 / 64])


def test_a_uniform_map_scores_the_chance_share_and_no_pointing_hit():
    labels = _labels()
    region = torch.tensor([1, 2])
    scores = region_scores(torch.ones(2, 8, 8), labels, region)
    assert scores["share"].tolist() == pytest.approx(scores["chance"].tolist())
    assert scores["pointing"].tolist() == [0.0, 0.0]  # a flat map's maximum is everywhere


def test_a_map_peaking_off_the_part_misses_the_pointing_game():
    labels = _labels()
    maps = torch.zeros(1, 8, 8)
    maps[0, 1:3, 1:3] = 0.5
    maps[0, 7, 7] = 1.0  # the peak on the background
    scores = region_scores(maps, labels[:1], torch.tensor([1]))
    assert scores["pointing"].item() == 0.0 and scores["share"].item() == pytest.approx(2 / 3)


def test_part_shares_split_the_mass_and_purity_is_one_minus_background():
    labels = _labels()
    maps = torch.zeros(2, 8, 8)
    maps[0] = (labels[0] == 2).float()
    maps[1, 0, 0], maps[1, 1, 1] = 3.0, 1.0
    shares = part_shares(maps, labels, 2)
    assert shares[0].tolist() == pytest.approx([0.0, 0.0, 1.0])
    assert shares[1].tolist() == pytest.approx([0.75, 0.25, 0.0])
    assert math.isnan(part_shares(torch.zeros(1, 8, 8), labels[:1], 2)[0, 0])


def _one_part_model(images: torch.Tensor) -> torch.Tensor:
    """A model whose embedding sees only the 4 x 4 top-left corner (one 'part')."""
    return F.normalize(images[:, :, :4, :4].flatten(1), dim=-1)


def test_deletion_of_the_only_part_that_matters_beats_the_random_order():
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(6, 3, 16, 16, generator=gen)
    gallery = _one_part_model(queries + 0.1 * torch.randn(6, 3, 16, 16, generator=gen))
    same = torch.ones(6, dtype=torch.bool)
    planted = torch.zeros(6, 16, 16)
    planted[:, :4, :4] = 1.0
    random_order = torch.rand(6, 16, 16, generator=gen)
    fr, deletion, insertion = perturbation_curves(
        _one_part_model, queries, gallery, same, planted, generator=gen
    )
    _, rnd_deletion, rnd_insertion = perturbation_curves(
        _one_part_model, queries, gallery, same, random_order, generator=gen
    )
    assert len(fr) == 21 and fr[1].item() == pytest.approx(0.05)
    assert deletion[:, 0].min() > 0.9 and deletion[:, -1].max() == pytest.approx(
        0.5
    )  # blank: cosine 0
    auc, rnd_auc = curve_auc(deletion, fr), curve_auc(rnd_deletion, fr)
    assert ((auc >= 0) & (auc <= 1)).all()
    assert auc.mean() < rnd_auc.mean() - 0.2
    assert curve_auc(insertion, fr).mean() > curve_auc(rnd_insertion, fr).mean()


def test_curves_equal_every_step_computed_one_by_one():
    """The curves' shared ends (intact and blank image) and chunking change nothing: each
    value is the target score of the query with the first k pixels removed or kept."""
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(8, 3, 12, 12, generator=gen)
    gallery = _one_part_model(torch.randn(8, 3, 12, 12, generator=gen))
    same = torch.tensor([True, False, True, True, False, True, False, False])
    scores = torch.rand(8, 12, 12, generator=gen)
    state = gen.get_state()
    done = []
    fr, deletion, insertion = perturbation_curves(
        _one_part_model,
        queries,
        gallery,
        same,
        scores,
        generator=gen,
        batch=7,
        on_chunk=done.append,
    )
    assert sum(done) == 8 and len(done) > 1  # masks built in chunks, images embedded 7 at a time
    gen.set_state(state)
    _, masks = perturbation_masks(scores, generator=gen)
    sign = torch.where(same, 1.0, -1.0)
    for i in range(8):
        for s in range(len(fr)):
            keep = masks[i, s]
            for curve, image in ((deletion, queries[i] * ~keep), (insertion, queries[i] * keep)):
                t = (_one_part_model(image[None])[0] * gallery[i]).sum() * sign[i]
                assert curve[i, s].item() == pytest.approx(((1 + t) / 2).item(), abs=1e-6)


def test_insertion_on_the_blurred_canvas_reveals_each_step_over_the_blurred_query():
    gen = torch.Generator().manual_seed(2)
    queries = torch.randn(5, 3, 12, 12, generator=gen)
    gallery = _one_part_model(torch.randn(5, 3, 12, 12, generator=gen))
    same = torch.tensor([True, False, True, False, True])
    scores = torch.rand(5, 12, 12, generator=gen)
    state = gen.get_state()
    fr, deletion, insertion = perturbation_curves(
        _one_part_model, queries, gallery, same, scores, generator=gen, canvas="blur"
    )
    gen.set_state(state)
    _, masks = perturbation_masks(scores, generator=gen)
    canvas = blurred_canvas(queries)
    sign = torch.where(same, 1.0, -1.0)
    for i in range(5):
        for s in range(len(fr)):
            keep = masks[i, s]
            shown = queries[i] * keep + canvas[i] * ~keep
            t = (_one_part_model(shown[None])[0] * gallery[i]).sum() * sign[i]
            assert insertion[i, s].item() == pytest.approx(((1 + t) / 2).item(), abs=1e-6)
    # deletion does not depend on the canvas
    gen.set_state(state)
    _, deletion_mean, _ = perturbation_curves(
        _one_part_model, queries, gallery, same, scores, generator=gen
    )
    assert torch.equal(deletion, deletion_mean)


def test_the_blurred_canvas_keeps_each_colour_and_loses_the_detail():
    stripes = torch.zeros(1, 3, 48, 48)
    stripes[:, 0, :, ::2] = 1.0  # a red stripe every other column
    stripes[:, 2] = 0.5  # a flat blue channel
    blurred = blurred_canvas(stripes)
    assert blurred.shape == stripes.shape
    assert blurred[:, 0].mean().item() == pytest.approx(0.5, abs=0.02)
    assert blurred[:, 0].std().item() < 0.05 < stripes[:, 0].std().item()
    assert torch.allclose(blurred[:, 2], stripes[:, 2], atol=1e-5)
    with pytest.raises(ValueError, match="insertion canvas"):
        perturbation_curves(
            _one_part_model,
            stripes,
            torch.ones(1, 48),
            torch.ones(1, dtype=torch.bool),
            torch.rand(1, 48, 48),
            canvas="noise",
        )


@pytest.mark.parametrize("eval_transform", ["resize", "resize_center_crop"])
def test_part_masks_are_shaped_as_the_eval_transform_shapes_the_images(tmp_path, eval_transform):
    splits = load_synthetic(tmp_path, num_classes=4, images_per_class=2, size=64)
    smoke = load_protocol("smoke")
    image = dataclasses.replace(smoke.image, size=48, resize=56, eval_transform=eval_transform)
    protocol = dataclasses.replace(smoke, image=image)
    ctx = RunContext("r", "plain", "synthetic", protocol, splits, None, torch.device("cpu"), {})
    labels = part_labels(ctx, np.array([0, 1]))
    assert load_images(ctx, np.array([0, 1])).shape[-2:] == labels.shape[-2:] == (48, 48)
    mask = torch.from_numpy(
        load_part_mask(splits.extras["root"], splits.extras["masks"][splits.test.keys()[1]]).copy()
    )[None]
    nearest = InterpolationMode.NEAREST
    if eval_transform == "resize":
        expected = TF.resize(mask, [48, 48], interpolation=nearest)
    else:
        expected = TF.center_crop(TF.resize(mask, 56, interpolation=nearest), 48)
    assert torch.equal(labels[1], expected[0])


def test_mean_interval_covers_the_mean_and_ignores_nan():
    mean, lo, hi = mean_interval([0.0, 1.0, 1.0, 0.0, float("nan")])
    assert mean == 0.5 and 0 <= lo < 0.5 < hi <= 1
    assert mean_interval([0.3]) == (0.3, 0.3, 0.3)


def test_near_miss_pairs_differ_in_exactly_one_part():
    parts = ["body", "head"]
    a = {"body": {"shape": "ellipse"}, "head": {"shape": "diamond"}}
    b = {"body": {"shape": "ellipse"}, "head": {"shape": "triangle"}}
    c = {"body": {"shape": "rectangle"}, "head": {"shape": "triangle"}}
    assert near_miss_class_pairs({0: a, 1: b, 2: c}, parts) == [(0, 1, 2), (1, 2, 1)]


# ------------------------------------------------------------------------ the command


def test_a_bad_run_id_is_one_error_line(workdir, capsys):
    assert main(["explain", "--run", "no-such-run"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: explain: no run 'no-such-run'")
    assert "Traceback" not in err


def test_bad_pairs_is_one_error_line(workdir, capsys):
    assert main(["explain", "--run", "x", "--pairs", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: explain: argument --pairs: expected an integer >= 1, got '0' "
        "(see python -m harness explain --help)"
    )


def _train(tiny_protocol, workdir, method: str) -> str:
    """A finished tiny run (no epoch: its initial weights are enough to explain, and fast)."""
    out = workdir / f"{method}.json"
    assert (
        main(
            [
                "run",
                "--methods",
                method,
                "--protocol",
                str(tiny_protocol),
                "--epochs",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())[0]["mlflow_run_id"]


def _check_scores(scores: dict) -> None:
    for key in (
        "pointing_game",
        "discriminative_part_share",
        "chance_part_share",
        "deletion_auc",
        "insertion_auc",
        "random_deletion_auc",
        "random_cells_deletion_auc",
        "random_cells_insertion_auc",
    ):
        assert 0.0 <= scores[key] <= 1.0, key
        lo, hi = scores[f"{key}_ci95"]
        assert lo <= scores[key] <= hi


def test_explain_end_to_end_on_a_tiny_run_with_and_without_own_maps(workdir, tiny_protocol, capsys):
    from harness.engine.explain.explain_run import explain_run
    from harness.engine.explain.maps import load_run

    run_id = _train(tiny_protocol, workdir, "agrouping")
    out = workdir / "explain.json"
    assert (
        main(
            [
                "explain",
                "--run",
                run_id,
                "--pairs",
                "6",
                "--curve-pairs",
                "2",
                "--out",
                str(workdir / "fig"),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    assert (
        record["pairs"] == 6 and record["curve_pairs"] == 2 and record["pair_kind"] == "near-miss"
    )
    _check_scores(record["method"])
    _check_scores(record["baseline"])
    assert record["method"]["chance_part_share"] == record["baseline"]["chance_part_share"]
    assert (workdir / "fig" / "pairs.png").is_file() and (workdir / "fig" / "curves.png").is_file()
    run = mlflow.MlflowClient().get_run(run_id)
    assert run.data.metrics[metric_key("explain", "method_pointing_game")] == pytest.approx(
        record["method"]["pointing_game"]
    )
    assert (
        run.data.metrics[metric_key("explain", "baseline_deletion_auc_lo")]
        <= run.data.metrics[metric_key("explain", "baseline_deletion_auc")]
    )
    logged = {a.path for a in mlflow.MlflowClient().list_artifacts(run_id, "explain")}
    assert {"explain/pairs.png", "explain/curves.png", "explain/scores.json"} <= logged

    # A method without maps: the baseline only, and a note saying so.
    plain = _train(tiny_protocol, workdir, "plain")
    capsys.readouterr()
    assert (
        main(
            [
                "explain",
                "--run",
                plain,
                "--pairs",
                "4",
                "--curve-pairs",
                "2",
                "--out",
                str(workdir / "p"),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "note: method 'plain' has no explanation maps of its own" in capsys.readouterr().err
    record = json.loads(out.read_text())
    assert record["method"] is None
    _check_scores(record["baseline"])

    # A dataset without part masks: deletion and insertion only, with a note.
    ctx = load_run(plain)
    ctx.splits.extras = {}
    record = explain_run(ctx, pairs=4, curve_pairs=2, out_dir=workdir / "nomask", figures=False)
    assert record["pair_kind"] == "nearest-neighbour"
    assert any("has no part masks" in n for n in record["notes"])
    assert (
        "pointing_game" not in record["baseline"] and 0 <= record["baseline"]["deletion_auc"] <= 1
    )

    # The table across methods, from the store.
    experiment = mlflow.MlflowClient().get_experiment(run.info.experiment_id).name
    assert main(["explain-table", "--experiment", experiment, "--out", str(workdir / "table")]) == 0
    markdown = (workdir / "table.md").read_text()
    assert "| agrouping | own maps |" in markdown and "| plain | Grad-CAM baseline |" in markdown
    assert "| plain | own maps |" not in markdown
    assert r"\begin{tabular}" in (workdir / "table.tex").read_text()


@pytest.mark.parametrize("name", list_methods(ablations=False))
def test_every_method_gives_pair_maps_or_declines_and_the_baseline_maps_every_one(name):
    from tests.methods.test_conformance import IMAGE, build

    model = build(name).eval()
    gen = torch.Generator().manual_seed(0)
    queries, gallery = (
        torch.randn(3, 3, *IMAGE, generator=gen),
        torch.randn(3, 3, *IMAGE, generator=gen),
    )
    same = torch.tensor([True, False, True])
    cam_q, cam_g, out = similarity_gradcam(model, queries, gallery, same)
    assert cam_q.shape[0] == cam_g.shape[0] == 3 and (cam_q >= 0).all() and (cam_g >= 0).all()
    head = model.head
    maps = None
    if isinstance(head, PairExplainer):
        with torch.no_grad():
            maps = head.pair_maps(
                output_rows(out, slice(0, 3)), output_rows(out, slice(3, None)), same
            )
        assert (maps is not None) == head.explains_pairs, (
            f"{name}: pair_maps gave {'maps' if maps is not None else 'None'}, but explains_pairs "
            f"is {head.explains_pairs} (a head whose maps depend on its options overrides it)"
        )
    if maps is not None:
        for m in maps:
            assert m.dim() == 3 and m.shape[0] == 3 and torch.isfinite(m).all() and (m >= 0).all()
            assert (m.flatten(1).sum(1) > 0).all()
