"""The sections of a protocol: one frozen dataclass per table of ``protocols/<name>.toml``
(``[backbone]``, ``[image]``, ``[sampling]``, ...), which :class:`harness.config.protocol.Protocol`
holds. Each field's annotation is its schema (types, ranges, finiteness;
:mod:`harness.config.schema`), validated by pydantic whenever a protocol is read or overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import Field

from harness.config.schema import SPEC_CONFIG, Bool, Float, Int, Str

__all__ = [
    "BackboneSpec",
    "ImageSpec",
    "EmbeddingSpec",
    "SamplingSpec",
    "OptimizerSpec",
    "ScheduleSpec",
    "TrainingSpec",
    "NumericsSpec",
    "LossSpec",
    "MinerSpec",
    "SplitSpec",
    "SelectionSpec",
    "EvaluationSpec",
    "MAX_STEPS",
    "MAX_EXAMPLES",
    "PRECISIONS",
    "SELECTION_MODES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# Every section below is validated by pydantic (harness.config.protocol) against its
# annotations: the types and ranges declared here are the protocol's schema, and what
# ``python -m harness schema`` publishes. Rules that relate two keys are those of
# ``Protocol.__post_init__``.

Positive = Field(gt=0)
NonNegative = Field(ge=0)
#: A seed: numpy's and torch's generators take 32-bit seeds.
Seed = Field(ge=0, lt=2**32)
#: Epochs, milestones and other counts of steps: a larger value is a mistake, not a plan.
MAX_STEPS = 100_000
#: The fewest and the most test embeddings a run's embedding map may draw.
MIN_MAP_POINTS, MAX_MAP_POINTS = 50, 5000
#: Most queries a run's retrieval examples show (a row each).
MAX_EXAMPLES = 60


@dataclass(frozen=True)
class BackboneSpec:
    __pydantic_config__ = SPEC_CONFIG
    name: Str = "resnet50"
    pretrained: Bool = True
    #: Optional path to a state dict (loaded with ``weights_only=True``).
    weights: Str = ""
    #: Roth et al. 2020: BN running statistics frozen (eval mode), affine still trained.
    freeze_bn: Bool = True
    #: BN's affine weights and biases frozen too (``requires_grad`` off, so no optimizer
    #: group holds them), as AVSL's trunks do (zbr17/AVSL src/avsl/models/resnet50_decom.py
    #: lines 20-25; zbr17/GeDML src/gedml/core/models/basic_models/resnet50.py lines 20-25).
    #: False (Roth et al., DIML's and DGML's code): the affine trains. Absent from the
    #: canonical form at its default (``_FINGERPRINT_OMITTED_AT_DEFAULT`` of
    #: :mod:`harness.config.protocol`).
    freeze_bn_affine: Bool = False
    #: The backbone's own conversion of its inputs, where it has one: torchvision's GoogLeNet
    #: with ImageNet weights re-normalises each channel (``transform_input``: channel 0
    #: becomes 0.458 x - 0.030). False skips it, as DGML-master's GoogLeNet does (it runs
    #: the network's children in a plain ``Sequential``, architectures/googlenet.py:18-19).
    #: A backbone without such a conversion refuses false. Absent from the canonical form
    #: at its default (``FINGERPRINT_OMITTED_AT_DEFAULT`` of :mod:`harness.config.protocol`).
    input_transform: Bool = True
    #: Input pixels per position of the last feature map: 32 (every registered backbone as
    #: published) or 16, the last stride-2 stage dilated instead (timm's ``output_stride``),
    #: so a small image keeps room to attend (96 px: a 6 x 6 map, not 3 x 3). The weights are
    #: the same; only the last stage's receptive field and cost change. Absent from the
    #: canonical form at its default (``FINGERPRINT_OMITTED_AT_DEFAULT`` of
    #: :mod:`harness.config.protocol`).
    output_stride: Literal[16, 32] = 32


@dataclass(frozen=True)
class ImageSpec:
    __pydantic_config__ = SPEC_CONFIG
    #: Pixels of a side: 32 (the smallest every backbone's five downsamplings keep) to 1024.
    size: Annotated[Int, Field(ge=32, le=1024)] = 224
    #: Eval: Resize(resize) then CenterCrop(size).
    resize: Annotated[Int, Field(gt=0, le=2048)] = 256
    train_transform: Str = "random_resized_crop_flip"
    #: Area range of RandomResizedCrop (torchvision's default: 0.08 to 1).
    crop_scale: Annotated[
        tuple[Annotated[Float, Field(gt=0, le=1)], ...], Field(min_length=2, max_length=2)
    ] = (0.08, 1.0)
    #: Aspect-ratio range of RandomResizedCrop (torchvision's default: 3/4 to 4/3).
    crop_ratio: Annotated[
        tuple[Annotated[Float, Positive], ...], Field(min_length=2, max_length=2)
    ] = (3 / 4, 4 / 3)
    #: ``random_resized_crop_flip`` only: Resize(train_resize) (the shorter side) before the
    #: crop; 0: the crop is taken from the image as read (AVSL's code resizes to 256 first,
    #: zbr17/AVSL examples/config/param/transforms/train_transforms.yaml lines 4-5). At most
    #: 2048, as ``resize``.
    train_resize: Annotated[Int, Field(ge=0, le=2048)] = 0
    eval_transform: Str = "resize_center_crop"
    #: ``multiscale_crop_flip``: the image is resized to s*size x s*size with s uniform in
    #: [low, high], then randomly cropped to size x size (DIABLO Sec. 3.5: [0.8, 1.8]).
    #: Empty (and absent from the canonical form) for the other transforms.
    multiscale_range: Annotated[tuple[Annotated[Float, Positive], ...], Field(max_length=2)] = ()
    mean: Annotated[tuple[Float, ...], Field(min_length=3, max_length=3)] = IMAGENET_MEAN
    std: Annotated[tuple[Annotated[Float, Positive], ...], Field(min_length=3, max_length=3)] = (
        IMAGENET_STD
    )


@dataclass(frozen=True)
class EmbeddingSpec:
    __pydantic_config__ = SPEC_CONFIG
    #: 2 (the least that can tell classes apart by direction) to 8192.
    size: Annotated[Int, Field(ge=2, le=8192)] = 128


@dataclass(frozen=True)
class SamplingSpec:
    __pydantic_config__ = SPEC_CONFIG
    #: At least two classes (negatives) and two images of each (positives) per batch.
    classes_per_batch: Annotated[Int, Field(ge=2, le=MAX_STEPS)] = 56
    samples_per_class: Annotated[Int, Field(ge=2, le=MAX_STEPS)] = 2
    #: 0: as many batches as the training images fill (N // batch size); classes are drawn
    #: uniformly per batch, so an epoch need not see every image (as PML's MPerClassSampler).
    batches_per_epoch: Annotated[Int, Field(ge=0, le=MAX_STEPS)] = 0
    #: Draw a batch's classes with replacement (a class may fill two of its slots), as
    #: wl-zhao/DIML's class sampler does (datasampler/class_random_sampler.py:42). False:
    #: ``classes_per_batch`` distinct classes.
    classes_with_replacement: Bool = False
    #: Draw each class's images with replacement (an image may appear twice in a batch), as
    #: DGML-master's (datasampler/class_random_sampler.py:43) and DIML's (l. 43) samplers
    #: do. False: distinct images while the class has enough.
    images_with_replacement: Bool = False
    #: ``"classes"``: each batch draws ``classes_per_batch`` classes x ``samples_per_class``
    #: images; ``"shuffle"``: batches of the same size cut from a random permutation of the
    #: training images, the last partial one dropped (PyTorch's ``DataLoader(shuffle=True,
    #: drop_last=True)``, what a trainer without a sampler does: zbr17/GeDML
    #: src/gedml/launcher/trainers/base_trainer.py lines 206-212).
    sampler: Literal["classes", "shuffle"] = "classes"
    #: The sampler of one loss, where the setting the protocol transcribes gives that loss
    #: another than ``sampler``: ``{proxy_anchor = "shuffle"}`` (AVSL's ProxyAnchor
    #: configurations name no sampler, its margin configuration a class sampler).
    loss_samplers: dict[Str, Literal["classes", "shuffle"]] = field(default_factory=dict)

    def sampler_for(self, loss: str) -> str:
        """The sampler a run of ``loss`` draws its batches with."""
        return self.loss_samplers.get(loss, self.sampler)

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class


@dataclass(frozen=True)
class OptimizerSpec:
    __pydantic_config__ = SPEC_CONFIG
    name: Literal["adam", "adamw", "rmsprop", "sgd"] = "adam"
    #: 0 freezes the backbone (a linear probe); the head must learn.
    lr_backbone: Annotated[Float, NonNegative] = 1e-5
    lr_head: Annotated[Float, Positive] = 1e-5
    #: Learning rate of loss parameters (margin beta, proxies).
    lr_loss: Annotated[Float, NonNegative] = 5e-4
    #: Weight decay of the loss parameters (0: none, the harness's default; GeDML's
    #: configurations decay every part, its losses and collectors included, by ``--wd``).
    loss_weight_decay: Annotated[Float, NonNegative] = 0.0
    weight_decay: Annotated[Float, NonNegative] = 4e-4
    momentum: Annotated[Float, Field(ge=0, lt=1)] = 0.9
    #: Gradient-norm clipping before each step: every optimizer parameter group (backbone,
    #: head, a head's own groups, loss) clipped on its own to this total L2 norm, as GeDML's
    #: ``gradclipper`` clips each module (zbr17/GeDML src/gedml/launcher/misc/utils.py lines
    #: 14-20, trainers/base_trainer.py lines 322-325). 0: no clipping.
    clip_grad_norm: Annotated[Float, NonNegative] = 0.0
    #: Which steps clip: ``every`` step, or the run's ``first`` step alone. ``first`` is what
    #: GeDML's clipper does: it keeps ``module.parameters()``, a generator
    #: (``launcher/creators/factories/grad_clipper_creator.py`` line 12), and hands that same
    #: generator to ``clip_grad_norm_`` at every step (``launcher/misc/utils.py`` lines
    #: 14-20): the first call exhausts it, and every later call clips nothing.
    clip_steps: Literal["every", "first"] = "every"


@dataclass(frozen=True)
class ScheduleSpec:
    __pydantic_config__ = SPEC_CONFIG
    name: Literal["constant", "multistep", "cosine"] = "constant"
    epochs: Annotated[Int, Field(ge=0, le=MAX_STEPS)] = 150
    milestones: tuple[Annotated[Int, Field(gt=0, le=MAX_STEPS)], ...] = ()
    gamma: Annotated[Float, Positive] = 0.1


@dataclass(frozen=True)
class TrainingSpec:
    """How the training loop runs, none of which changes a number it computes (so it is
    left out of the fingerprint, :func:`fingerprint`)."""

    __pydantic_config__ = SPEC_CONFIG
    #: Training steps between two reads of the device (losses, the non-finite check, the
    #: progress bar, ``train/loss``): in between, the loop only queues work, so a GPU never
    #: waits for the host. The end of an epoch is always read.
    sync_every: Annotated[Int, Field(gt=0, le=MAX_STEPS)] = 50


Precision = Literal["bf16", "fp32"]
PRECISIONS = get_args(Precision)


@dataclass(frozen=True)
class NumericsSpec:
    """The arithmetic a run trains and embeds in (:func:`harness.base.device.amp_dtype`)."""

    __pydantic_config__ = SPEC_CONFIG
    #: ``"bf16"``: on a GPU, forward passes and losses under autocast (bfloat16 where the
    #: device supports it, else float16 with a loss scaler); ``"fp32"``: no autocast, as
    #: every released code of the seeds runs. On a CPU both are float32.
    precision: Precision = "bf16"


@dataclass(frozen=True)
class LossSpec:
    __pydantic_config__ = SPEC_CONFIG
    #: The default metric loss of this protocol.
    name: Str = "margin"
    #: Hyperparameters per loss the protocol sanctions: ``{loss_name: {arg: value}}``.
    #: Choosing a sanctioned loss with ``--loss`` is a run axis, not a deviation.
    args: dict[Str, dict[Str, Any]] = field(default_factory=dict)
    #: The miner of one loss, when the setting the protocol transcribes gives that loss
    #: another miner than ``[miner]``: ``[loss.miners.binomial_deviance] name = "none"``
    #: (``{loss_name: {"name": miner, "args": {...}}}``; see :func:`harness.components.losses.miner_for`).
    #: Empty (and absent from the canonical form) in protocols that do not use it.
    miners: dict[Str, dict[Str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class MinerSpec:
    __pydantic_config__ = SPEC_CONFIG
    name: Str = "none"
    args: dict[Str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SplitSpec:
    __pydantic_config__ = SPEC_CONFIG
    #: Fraction of training classes carved out, class-disjointly, for validation.
    validation_classes: Annotated[Float, Field(ge=0, lt=1)] = 0.2
    seed: Annotated[Int, Seed] = 0
    #: Carve the validation classes with the run's seed instead of ``seed``: every seed
    #: trains and selects on its own random class split (DIABLO Sec. 4.2, ten random
    #: train/val splits). The caps below stay on ``seed``, so the test set is the same for
    #: every run. False (and absent from the canonical form) keeps one carve for all seeds.
    validation_by_run_seed: Bool = False
    #: Cap on images per class (0 = all), seeded; used by small CPU protocols.
    max_train_images_per_class: Annotated[Int, Field(ge=0, le=MAX_STEPS)] = 0
    max_test_images_per_class: Annotated[Int, Field(ge=0, le=MAX_STEPS)] = 0


SelectionMode = Literal["validation", "last", "test-paper"]
SELECTION_MODES = get_args(SelectionMode)


@dataclass(frozen=True)
class SelectionSpec:
    __pydantic_config__ = SPEC_CONFIG
    #: "validation" (fair, default), "last" (final epoch) or "test-paper"
    #: (mimics the seeds' released code; labelled in every table it reaches).
    mode: SelectionMode = "validation"
    metric: Str = "mean_average_precision_at_r"
    evaluate_every: Annotated[Int, Field(ge=1, le=MAX_STEPS)] = 1
    #: Epochs up to this one (counted from 1) are neither evaluated nor selected: the
    #: selection window of DGML-master, which evaluates and keeps a checkpoint only once
    #: ``epoch > eval_begin`` (``main.py`` line 69; ``eval_begin`` 49 on CUB, 69 on Cars, 80
    #: on SOP). A run with no epoch after it (a smoke run) is evaluated at its last epoch
    #: alone. 0: every epoch may be selected.
    after_epoch: Annotated[Int, Field(ge=0, le=MAX_STEPS)] = 0

    def due(self, epoch: int, epochs: int) -> bool:
        """Whether the selection evaluates after epoch ``epoch`` (counted from 1) of a run
        of ``epochs``: every ``evaluate_every``-th epoch and the last, within the window."""
        if epoch <= min(self.after_epoch, epochs - 1):
            return False
        return epoch % self.evaluate_every == 0 or epoch == epochs


@dataclass(frozen=True)
class EvaluationSpec:
    __pydantic_config__ = SPEC_CONFIG
    #: Names as in ``harness.components.evaluation`` (PML's spelling where it has one).
    #: Validation during training computes only the retrieval ones.
    metrics: Annotated[tuple[Str, ...], Field(min_length=1)] = (
        "precision_at_1",
        "recall_at_k",
        "r_precision",
        "mean_average_precision_at_r",
        "map_at_c",
        "nmi",
        "f1",
    )
    #: Recall@K values per dataset name; "default" applies to the rest.
    recall_k: dict[Str, Annotated[tuple[Annotated[Int, Positive], ...], Field(min_length=1)]] = (
        field(
            default_factory=lambda: {
                "default": (1, 2, 4, 8),
                "sop": (1, 10, 100, 1000),
                "inshop": (1, 10, 20, 30, 40, 50),
            }
        )
    )
    #: Images per evaluation batch. On CPU at most ``CPU_FORWARD_BATCH`` (32) go through the
    #: model at once (harness.engine.run.embedding): the embeddings are the same, only faster.
    batch_size: Annotated[Int, Field(gt=0, le=MAX_STEPS)] = 128
    #: Test queries in the run's retrieval examples, each drawn with its top
    #: neighbours (the worst, the best and seeded random ones, a third each), whose classes
    #: the run's embedding map marks (:mod:`harness.reports.figures.views`); 0 draws
    #: neither figure. A figure changes no number: left out of the fingerprint
    #: (:func:`harness.config.fingerprint.fingerprint`) and, at its default, of the
    #: canonical form.
    examples: Annotated[Int, Field(ge=0, le=MAX_EXAMPLES)] = 6
    #: Most test embeddings the run's embedding map draws (a sample drawn with the run's
    #: seed above it, the example queries always in it): t-SNE's cost grows with them. Like
    #: ``examples``, it changes no number.
    map_points: Annotated[Int, Field(ge=MIN_MAP_POINTS, le=MAX_MAP_POINTS)] = MAX_MAP_POINTS

    def recall_k_for(self, dataset: str) -> tuple[int, ...]:
        return tuple(self.recall_k.get(dataset, self.recall_k.get("default", (1,))))
