"""The released AVSL code's training recipe as protocol settings and plugin options (zbr17/AVSL
with zbr17/GeDML's trainer): gradient clipping, the collector's proxies and rates, the
batch's classes' proxies on SOP, the training transform, shuffled ProxyAnchor batches, the
hard selector with four margin losses, and float32 arithmetic. Each test checks the
setting's effect (a gradient, a parameter group, a batch, a crop, a context), not only its
value in the protocol."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from harness.base.device import amp_dtype, amp_name
from harness.components.data.sampling import (
    ClassBalancedBatchSampler,
    ShuffledBatchSampler,
    batch_sampler,
)
from harness.components.data.transforms import build_transform
from harness.components.gradients import clip_gradients
from harness.components.losses import MetricLoss, create_loss, create_miner, hard_triplets
from harness.config.fingerprint import fingerprint
from harness.config.grids import load_grid
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol
from harness.methods import TrainingBatch
from harness.methods.roles import metric_loss_groups
from tests.methods.test_conformance import BATCH, EMB, build, images

# ------------------------------------------------------------- 5: gradient clipping


def _grads(scale: float) -> torch.optim.Optimizer:
    a, b = nn.Parameter(torch.zeros(50)), nn.Parameter(torch.zeros(7, 3))
    a.grad = torch.full_like(a, scale)
    b.grad = torch.full_like(b, -scale)
    return torch.optim.AdamW([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 1.0}])


def test_clip_grad_norm_clips_each_parameter_group_to_the_norm():
    opt = _grads(5.0)  # group norms 35.4 and 22.9
    clip_gradients(opt, 10.0)
    norms = [
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in g["params"]]))
        for g in opt.param_groups
    ]
    assert all(abs(float(n) - 10.0) < 1e-4 for n in norms)
    small = _grads(0.1)  # under the norm: untouched
    clip_gradients(small, 10.0)
    assert float(small.param_groups[0]["params"][0].grad[0]) == pytest.approx(0.1)
    off = _grads(5.0)
    clip_gradients(off, 0.0)
    assert float(off.param_groups[0]["params"][0].grad[0]) == 5.0


def test_the_avsl_protocol_clips_at_10_and_the_default_leaves_fingerprints_alone():
    assert load_protocol("avsl").optimizer.clip_grad_norm == 10.0
    base = load_protocol("roth2020")
    assert (
        base.optimizer.clip_grad_norm == 0.0 and "clip_grad_norm" not in base.to_dict()["optimizer"]
    )
    clipped, deviations = apply_overrides(base, {"optimizer.clip_grad_norm": 10.0})
    assert clipped.to_dict()["optimizer"]["clip_grad_norm"] == 10.0 and len(deviations) == 1
    assert fingerprint(clipped, "d") != fingerprint(base, "d")
    same, _ = apply_overrides(base, {"optimizer.clip_grad_norm": 0.0})
    assert fingerprint(same, "d") == fingerprint(base, "d")


# --------------------------------------------- 6: the proxies in the collector's group


@pytest.mark.parametrize(
    ("dataset", "rate"), [("cub200", 1.1e-4), ("cars196", 0.09918213648327627), ("sop", 0.06)]
)
def test_avsl_proxies_train_at_the_collector_rate_with_weight_decay(dataset, rate):
    protocol = load_protocol("avsl").for_dataset(dataset)
    head = build("avsl", **protocol.methods["avsl"]).head
    losses = nn.ModuleList(
        create_loss("proxy_anchor", num_classes=5, embedding_size=EMB)
        for _ in range(head.metric_loss_copies)
    )
    groups = {
        g["name"]: g
        for g in head.optimizer_groups(protocol.optimizer.lr_head, protocol.optimizer.weight_decay)
        + head.loss_optimizer_groups(losses, protocol.optimizer)
    }
    assert (
        groups["proxies"]["lr"] == pytest.approx(rate) and groups["proxies"]["weight_decay"] == 1e-4
    )
    assert {id(p) for p in groups["proxies"]["params"]} == {id(m.proxies) for m in losses}
    assert "loss" not in groups  # ProxyAnchor has no other parameter
    assert groups["inference"]["lr"] == pytest.approx(rate)  # alpha, beta: the same collector
    # The harness's default: the proxies in the loss group at lr_loss without decay.
    default = metric_loss_groups(losses, load_protocol("roth2020").optimizer)
    assert [g["name"] for g in default] == ["loss"] and default[0]["weight_decay"] == 0.0


def test_margin_beta_stays_in_the_loss_group_at_the_protocol_loss_rate_and_decay():
    protocol = load_protocol("avsl").for_dataset("cub200")
    head = build("avsl", **protocol.methods["avsl"]).head
    losses = nn.ModuleList(
        create_loss("margin", num_classes=5, embedding_size=EMB)
        for _ in range(head.metric_loss_copies)
    )
    groups = head.loss_optimizer_groups(losses, protocol.optimizer)
    # clip_units = "code": each margin loss is its own clipping unit, a group per beta.
    assert len(groups) == 4  # four margin losses, a beta each
    for group in groups:
        assert group["name"] == "loss" and group["lr"] == 0.01 and group["weight_decay"] == 1e-4
        assert len(group["params"]) == 1


# ------------------------------------------------- 7: the batch's classes' proxies (SOP)


def _proxy_step(**options):
    torch.manual_seed(0)
    model = build("avsl", **options).train()
    head = model.head
    losses = [
        create_loss("proxy_anchor", num_classes=12, embedding_size=EMB)
        for _ in range(head.metric_loss_copies)
    ]
    metric = MetricLoss(nn.ModuleList(losses))
    labels = torch.tensor([1, 1, 4, 4, 7, 7, 9, 9])
    x = images()
    terms = head.loss_terms(model(x), TrainingBatch(labels, metric, x, model))
    sum(terms.values()).backward()
    return losses, terms, labels


def test_batch_proxies_give_gradient_only_to_the_batch_classes_proxies():
    losses, terms, labels = _proxy_step(batch_proxies=True)
    batch = torch.zeros(12, dtype=torch.bool)
    batch[labels.unique()] = True
    for loss in losses:
        touched = loss.proxies.grad.abs().sum(1) > 0
        assert torch.equal(touched, batch)
        assert isinstance(loss.proxies, nn.Parameter) and loss.num_classes == 12  # restored
    all_losses, _, _ = _proxy_step()
    assert (all_losses[0].proxies.grad[~batch].abs().sum(1) > 0).all()  # every proxy otherwise


def test_batch_proxies_average_the_negative_terms_over_the_batch_classes():
    """The code's ProxyAnchor (proxy_anchor_loss.py line 87) averages the negative terms
    over the columns it is given: with the batch's 4 classes of 12, the level loss is the
    loss of a 4-class problem on those proxies."""
    torch.manual_seed(0)
    emb = nn.functional.normalize(torch.randn(8, EMB), dim=1)
    labels = torch.tensor([1, 1, 4, 4, 7, 7, 9, 9])
    loss = create_loss("proxy_anchor", num_classes=12, embedding_size=EMB)
    small = create_loss("proxy_anchor", num_classes=4, embedding_size=EMB)
    small.proxies.data = loss.proxies.data[labels.unique()].clone()
    from harness.methods.avsl_losses import batch_class_proxies

    with batch_class_proxies(loss, labels) as local:
        got = loss(emb, local)
    torch.testing.assert_close(got, small(emb, torch.unique(labels, return_inverse=True)[1]))
    assert not torch.allclose(loss(emb, labels), got)


# ------------------------------------------------------------ 8: the training transform


def _crop_areas(pipeline, image, draws=400) -> np.ndarray:
    """Fractions of the (resized) image's area that the pipeline's RandomResizedCrop takes."""
    ops = pipeline.transforms
    crop = next(op for op in ops if type(op).__name__ == "RandomResizedCrop")
    before = ops[: ops.index(crop)]
    for op in before:
        image = op(image)
    width, height = image.size
    torch.manual_seed(0)
    return np.array(
        [
            h * w / (height * width)
            for _, _, h, w in (crop.get_params(image, crop.scale, crop.ratio) for _ in range(draws))
        ]
    )


def test_avsl_training_transform_resizes_to_256_then_crops_16_to_100_percent():
    image = Image.new("RGB", (500, 375))
    avsl = build_transform(load_protocol("avsl").image, train=True)
    assert type(avsl.transforms[0]).__name__ == "Resize" and avsl.transforms[0].size == 256
    out = avsl(image)
    assert tuple(out.shape) == (3, 224, 224)
    areas = _crop_areas(avsl, image)
    assert areas.min() >= 0.16 - 1e-2  # integer rounding of the crop's sides
    harness = _crop_areas(build_transform(load_protocol("roth2020").image, train=True), image)
    assert (harness < 0.15).mean() > 0.05  # scale from 0.08
    ratio = avsl.transforms[1].ratio
    assert tuple(ratio) == (0.75, 1.33)


# ------------------------------------------------- 9: shuffled batches for ProxyAnchor


def test_proxy_anchor_batches_are_shuffled_and_margin_batches_class_balanced():
    sampling = load_protocol("avsl").sampling
    labels = np.repeat(np.arange(100), 10)  # 1,000 images, 100 classes
    kw = dict(classes_per_batch=45, samples_per_class=4, seed=0)
    shuffled = batch_sampler(sampling, labels, loss="proxy_anchor", **kw)
    balanced = batch_sampler(sampling, labels, loss="margin", **kw)
    assert isinstance(shuffled, ShuffledBatchSampler) and isinstance(
        balanced, ClassBalancedBatchSampler
    )
    batches = list(shuffled)
    assert len(batches) == 1000 // 180 and all(len(b) == 180 for b in batches)
    flat = np.concatenate(batches)
    assert len(np.unique(flat)) == len(flat)  # one permutation: no image twice in an epoch
    counts = [np.unique(labels[b], return_counts=True)[1] for b in batches]
    assert any(len(c) != 45 or (c != 4).any() for c in counts)  # not 45 classes x 4
    for batch in balanced:
        classes, per = np.unique(labels[batch], return_counts=True)
        assert len(classes) == 45 and (per == 4).all()
    again = batch_sampler(sampling, labels, loss="proxy_anchor", **kw)
    assert [list(b) for b in again] == [list(b) for b in batches]  # seeded by (seed, epoch)
    again.set_epoch(1)
    assert [list(b) for b in again] != [list(b) for b in batches]


def test_shuffled_shares_split_the_global_batch_in_rank_order():
    labels = np.repeat(np.arange(20), 9)
    whole = list(ShuffledBatchSampler(labels, batch_size=40, seed=3))
    shares = [
        list(ShuffledBatchSampler(labels, batch_size=40, seed=3, rank=r, world_size=2))
        for r in range(2)
    ]
    assert [a + b for a, b in zip(*shares, strict=True)] == whole


# --------------------------------------- 10: hard negatives and four margin losses


def test_hard_triplets_are_gedmls_hard_selector_by_hand():
    labels = torch.tensor([0, 0, 1, 1, 2])
    dist = torch.tensor(
        [
            [0.0, 0.3, 0.9, 0.2, 0.1],
            [0.3, 0.0, 0.6, 0.7, 0.8],
            [0.9, 0.6, 0.0, 0.4, 0.2],
            [0.2, 0.7, 0.4, 0.0, 0.5],
            [0.1, 0.8, 0.2, 0.5, 0.0],
        ]
    )
    mined = hard_triplets(dist, labels, cutoff=0.5)
    assert mined.valid.tolist() == [True, True, True, True, False]  # item 4 has no positive
    a, p, n = mined.compact()
    # Largest positive distance 0.4 < 0.5: negatives are clamped at 0.4 from below.
    assert a.tolist() == [0, 1, 2, 3]  # item 4 has no positive
    assert p.tolist() == [1, 0, 3, 2]
    # 0: negatives 0.9, 0.2, 0.1 -> clamped 0.9, 0.4, 0.4: the lower index (3) wins the tie.
    # 1: 0.6, 0.7, 0.8 (none below the floor): the nearest, 2. 2: 0.9, 0.6, 0.2 -> 4.
    # 3: 0.2, 0.7, 0.5 -> 0.4, 0.7, 0.5: 0.
    assert n.tolist() == [3, 2, 4, 0]


def test_the_hard_negative_miner_is_hard_triplets_on_the_euclidean_distance():
    torch.manual_seed(1)
    emb = torch.nn.functional.normalize(torch.randn(12, 6), dim=1)
    labels = torch.arange(12) // 3
    torch.manual_seed(5)
    mined = create_miner("hard_negative")(emb, labels)
    torch.manual_seed(5)
    expected = hard_triplets(torch.cdist(emb, emb), labels, cutoff=0.5)
    for got, want in zip(mined.compact(), expected.compact(), strict=True):
        assert torch.equal(got, want)
    assert load_protocol("avsl").miner.name == "hard_negative"


def _margin_step(**options):
    torch.manual_seed(0)
    model = build("avsl", **options).train()
    head = model.head
    losses = [
        create_loss("margin", num_classes=4, embedding_size=EMB)
        for _ in range(head.metric_loss_copies)
    ]
    metric = MetricLoss(nn.ModuleList(losses))
    labels = torch.arange(BATCH) // 2
    x = images()
    out = model(images(3))  # non-zero edges
    out = model(x)
    terms = head.loss_terms(out, TrainingBatch(labels, metric, x, model))
    return head, losses, terms


def test_margin_avsl_has_four_margin_losses_and_mines_hard_negatives():
    head, losses, terms = _margin_step(
        level_miner="hard", final_loss="separate", distance="squared"
    )
    assert head.metric_loss_copies == 4
    terms["final"].backward()
    assert losses[3].beta.grad is not None and losses[3].beta.grad.abs().sum() > 0
    assert all(loss.beta.grad is None for loss in losses[:3])  # the final loss has its own beta
    shared_head, shared, shared_terms = _margin_step(distance="squared")
    assert shared_head.metric_loss_copies == 3
    shared_terms["final"].backward()
    assert shared[2].beta.grad is not None  # the default: level 3's beta serves the final loss


def test_hard_mining_changes_the_level_losses_against_the_protocol_miner():
    torch.manual_seed(0)
    model = build("avsl", distance="squared", level_miner="hard").train()
    hard_head = model.head
    losses = [create_loss("margin", num_classes=4, embedding_size=EMB) for _ in range(3)]
    labels = torch.arange(BATCH) // 2
    x = images()
    out = model(x)
    metric = MetricLoss(nn.ModuleList(losses), create_miner("distance_weighted"))
    metric.set_step(0, 0, 0)
    hard = hard_head.loss_terms(out, TrainingBatch(labels, metric, x, model))
    hard_head.level_miner = "protocol"
    metric.set_step(0, 0, 0)
    weighted = hard_head.loss_terms(out, TrainingBatch(labels, metric, x, model))
    assert not torch.isclose(hard["metric_level1"], weighted["metric_level1"])
    metric.set_step(0, 0, 0)
    hard_head.level_miner = "hard"
    again = hard_head.loss_terms(out, TrainingBatch(labels, metric, x, model))
    torch.testing.assert_close(again["metric_level1"], hard["metric_level1"])  # seeded per step


def test_hard_mining_leaves_proxy_losses_to_their_own_miner():
    losses, terms, _ = _proxy_step(level_miner="hard")
    plain_losses, plain_terms, _ = _proxy_step()
    for key in terms:
        torch.testing.assert_close(terms[key], plain_terms[key])


# ------------------------------------------------------------------- 11: float32


def test_fp32_turns_autocast_off_on_a_gpu_and_bf16_is_the_default():
    cuda = torch.device("cuda")
    assert amp_dtype(cuda, "fp32") is None and amp_name(cuda, "fp32") == "off"
    assert amp_dtype(torch.device("cpu"), "bf16") is None  # CPU: float32 either way
    assert load_protocol("roth2020").numerics.precision == "bf16"
    with pytest.raises(Exception, match="precision"):
        amp_dtype(cuda, "fp16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_autocasts_on_a_gpu():
    assert amp_dtype(torch.device("cuda"), "bf16") in (torch.bfloat16, torch.float16)


def test_reproduce_protocols_with_released_code_run_fp32_and_the_others_declare_bf16():
    for name in ("agrouping", "agrouping-googlenet", "agrouping-sec42", "avsl"):
        assert load_protocol(name).numerics.precision == "fp32", name
    for cell in load_grid("diml-table1").cells:
        assert cell.protocol.numerics.precision == "fp32"
    for name in ("roth2020", "diablo", "diablo-ablation", "sam"):
        protocol = load_protocol(name)
        assert protocol.numerics.precision == "bf16" and "mixed_precision" in protocol.deviations, (
            name
        )
        assert "numerics" not in protocol.to_dict()  # the default: fingerprints as before


# ------------------------------------------- the settings in the engine's training step


def _engine_step(overrides: dict, steps=((0, 0),)):
    """Training steps ``(epoch, step)`` of AVSL on the tiny protocol through the public
    trainer, with the gradient norm of each parameter group read where the optimizer steps
    (the trainer, and the norms of the first step)."""
    from harness.engine.run import RunConfig, prepare_splits
    from harness.engine.run.recorder import InMemoryRecorder
    from harness.engine.run.trainer import Trainer
    from tests.conftest import TINY_PROTOCOL

    protocol, _ = apply_overrides(load_protocol(TINY_PROTOCOL), overrides)
    splits = prepare_splits(protocol, "synthetic", None, seed=0)
    cfg = RunConfig.build(protocol, method="avsl", dataset="synthetic", loss="proxy_anchor", seed=0)
    trainer = Trainer.from_config(cfg, splits, recorder=InMemoryRecorder())
    norms = []
    step = trainer.parts.scaler.step

    def spy(optimizer):
        norms.append(
            {
                g["name"]: float(
                    torch.linalg.vector_norm(
                        torch.cat([p.grad.flatten() for p in g["params"] if p.grad is not None])
                    )
                )
                for g in optimizer.param_groups
            }
        )
        return step(optimizer)

    trainer.parts.scaler.step = spy
    images, labels, _ = next(iter(trainer.batches.loader))
    for epoch, index in steps:
        trainer.train_step(images, labels, epoch, index)
    trainer.norms = norms
    return trainer, norms[0]


def test_the_training_step_clips_samples_and_groups_as_the_protocol_says():
    recipe = {
        "optimizer.clip_grad_norm": 0.01,
        "sampling.loss_samplers": {"proxy_anchor": "shuffle"},
        "methods.avsl.proxies_in_collector": True,
        "methods.avsl.collector_lr": 0.05,
    }
    trainer, norms = _engine_step(recipe)
    assert isinstance(trainer.batches.sampler, ShuffledBatchSampler)
    groups = {g["name"]: g for g in trainer.parts.optimizer.param_groups}
    assert groups["proxies"]["lr"] == 0.05 and groups["proxies"]["weight_decay"] == 4e-4
    assert "loss" not in groups
    assert all(norm <= 0.01 * (1 + 1e-4) for norm in norms.values()), norms
    _, unclipped = _engine_step({})
    assert max(unclipped.values()) > 0.01  # the bound above was a clip, not the gradients' size


def test_clip_steps_first_clips_the_runs_first_step_alone_as_gedml_does():
    """GeDML's clipper exhausts its generator of parameters at its first call
    (grad_clipper_creator.py:12, utils.py:14-20): later steps are not clipped."""
    steps = ((0, 0), (0, 1), (1, 0))
    recipe = {"optimizer.clip_grad_norm": 0.01, "optimizer.clip_steps": "first"}
    first = _engine_step(recipe, steps)[0].norms
    assert max(first[0].values()) <= 0.01 * (1 + 1e-4)
    assert all(max(norms.values()) > 0.01 for norms in first[1:]), first
    every = _engine_step({"optimizer.clip_grad_norm": 0.01}, steps)[0].norms
    assert all(max(norms.values()) <= 0.01 * (1 + 1e-4) for norms in every), every
