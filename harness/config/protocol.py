"""Fair protocols as data: ``protocols/<name>.toml`` parsed into a frozen, validated object.

A protocol fixes everything that must be equal for two numbers to be comparable:
backbone and weights, image size and transforms, embedding size, batch sampling,
optimizer, schedule, splits, model selection and metrics. Each section's
annotations are its schema (types, ranges, finiteness; :mod:`harness.config.schema`),
validated by pydantic whenever a protocol is read or overridden; unknown keys are
errors naming the key (OML silently drops them; we do not). Command-line
overrides are allowed, but each one is recorded as a named :class:`Deviation`
and changes the fingerprint.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, TypeAdapter, ValidationError

from harness.base.errors import HarnessError, unknown_name
from harness.base.paths import read_text
from harness.config.deviations import PaperDeviation, check_names
from harness.config.options import check_loss_arg_values, check_option_values
from harness.config.schema import SPEC_CONFIG, Bool, Float, Int, Str, refusal, shown

__all__ = [
    "Protocol",
    "PRECISIONS",
    "Deviation",
    "load_protocol",
    "list_protocols",
    "apply_overrides",
    "protocol_dir",
    "fingerprint",
    "flatten_keys",
    "protocol_json_schema",
    "check_batch_fits",
    "protocol_from_dict",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# Every section below is validated by pydantic (``_validated``) against its annotations:
# the types and ranges declared here are the protocol's schema, and what
# ``python -m harness schema`` publishes. Rules that relate two keys are ``__post_init__``'s.

Positive = Field(gt=0)
NonNegative = Field(ge=0)
#: A seed: numpy's and torch's generators take 32-bit seeds.
Seed = Field(ge=0, lt=2**32)
#: Epochs, milestones and other counts of steps: a larger value is a mistake, not a plan.
MAX_STEPS = 100_000


@dataclass(frozen=True)
class BackboneSpec:
    __pydantic_config__ = SPEC_CONFIG
    name: Str = "resnet50"
    pretrained: Bool = True
    #: Optional path to a state dict (loaded with ``weights_only=True``).
    weights: Str = ""
    #: Roth et al. 2020: BN running statistics frozen (eval mode), affine still trained.
    freeze_bn: Bool = True
    #: The backbone's own conversion of its inputs, where it has one: torchvision's GoogLeNet
    #: with ImageNet weights re-normalises each channel (``transform_input``: channel 0
    #: becomes 0.458 x - 0.030). False skips it, as DGML-master's GoogLeNet does (it runs
    #: the network's children in a plain ``Sequential``, architectures/googlenet.py:18-19).
    #: A backbone without such a conversion refuses false. Absent from the canonical form
    #: at its default (:data:`_FINGERPRINT_OMITTED_AT_DEFAULT`).
    input_transform: Bool = True
    #: Input pixels per position of the last feature map: 32 (every registered backbone as
    #: published) or 16, the last stride-2 stage dilated instead (timm's ``output_stride``),
    #: so a small image keeps room to attend (96 px: a 6 x 6 map, not 3 x 3). The weights are
    #: the same; only the last stage's receptive field and cost change. Absent from the
    #: canonical form at its default (:data:`_FINGERPRINT_OMITTED_AT_DEFAULT`).
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
    #: zbr17/AVSL examples/config/param/transforms/train_transforms.yaml lines 4-5).
    train_resize: Annotated[Int, NonNegative] = 0
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
    #: model at once (harness.engine.embedding): the embeddings are the same, only faster.
    batch_size: Annotated[Int, Field(gt=0, le=MAX_STEPS)] = 128

    def recall_k_for(self, dataset: str) -> tuple[int, ...]:
        return tuple(self.recall_k.get(dataset, self.recall_k.get("default", (1,))))


@dataclass(frozen=True)
class Protocol:
    __pydantic_config__ = SPEC_CONFIG
    name: Str
    description: Str = ""
    #: Paper or source the protocol transcribes.
    source: Str = ""
    seeds: Annotated[tuple[Annotated[Int, Seed], ...], Field(min_length=1)] = (0,)
    backbone: BackboneSpec = BackboneSpec()
    image: ImageSpec = ImageSpec()
    embedding: EmbeddingSpec = EmbeddingSpec()
    sampling: SamplingSpec = SamplingSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    training: TrainingSpec = TrainingSpec()
    numerics: NumericsSpec = NumericsSpec()
    loss: LossSpec = LossSpec()
    miner: MinerSpec = MinerSpec()
    splits: SplitSpec = SplitSpec()
    selection: SelectionSpec = SelectionSpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    #: Method options fixed by this protocol: ``{method: {option: value}}``.
    methods: dict[Str, dict[Str, Any]] = field(default_factory=dict)
    #: Settings for one dataset, part of the protocol (not deviations), as partial protocol
    #: tables: ``[datasets.sop.schedule] epochs = 100``. :meth:`for_dataset` applies them.
    datasets: dict[Str, dict[Str, Any]] = field(default_factory=dict)
    #: Where this protocol departs from its paper or the authors' code (documentation:
    #: recorded and printed with every run, not fingerprinted): ``[deviations.<name>]``.
    deviations: dict[Str, PaperDeviation] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """The rules that relate two keys (each key's own type and range is its annotation's)."""
        image, splits = self.image, self.splits
        _check(
            image.resize >= image.size,
            "image.resize",
            image.resize,
            f">= image.size ({image.size})",
        )
        _check(
            image.crop_scale[0] <= image.crop_scale[1],
            "image.crop_scale",
            list(image.crop_scale),
            "[low, high] with low <= high",
        )
        _check(
            image.crop_ratio[0] <= image.crop_ratio[1],
            "image.crop_ratio",
            list(image.crop_ratio),
            "[low, high] with low <= high",
        )
        _check(
            self.selection.mode != "validation" or splits.validation_classes > 0,
            "splits.validation_classes",
            splits.validation_classes,
            '> 0 when selection.mode is "validation"',
        )
        multiscale = image.multiscale_range
        _check(
            image.train_transform != "multiscale_crop_flip"
            or (len(multiscale) == 2 and multiscale[0] <= multiscale[1]),
            "image.multiscale_range",
            list(multiscale),
            "[low, high] with 0 < low <= high for multiscale_crop_flip",
        )
        _check(
            not splits.validation_by_run_seed or splits.validation_classes > 0,
            "splits.validation_by_run_seed",
            True,
            "false unless splits.validation_classes > 0 (a carve to seed)",
        )
        _check(
            splits.max_train_images_per_class != 1,
            "splits.max_train_images_per_class",
            1,
            "0 (all) or >= 2 (a class needs two images to make a positive pair)",
        )

    def to_dict(self) -> dict[str, Any]:
        """The canonical form (fingerprinted): the optional keys (``_OPTIONAL_KEYS``) are
        absent while at their defaults, so a protocol that does not use them has the
        fingerprint (and sweep cell keys) it would have without them."""
        data = self._full_dict()
        del data["deviations"]  # documentation of the protocol, not a setting
        if not data["datasets"]:
            del data["datasets"]
        for section, key in _OPTIONAL_KEYS:
            if data[section][key] == _jsonable(getattr(getattr(Protocol, section), key)):
                del data[section][key]
        if data["training"] == _jsonable(dataclasses.asdict(TrainingSpec())):
            del data["training"]  # absent at its defaults, as the optional keys
        for dotted, default in _FINGERPRINT_OMITTED_AT_DEFAULT.items():
            section, key = dotted.split(".")
            if data[section].get(key, default) == _jsonable(default):
                data[section].pop(key, None)
                if not data[section]:
                    del data[section]
        return data

    def _full_dict(self) -> dict[str, Any]:
        """Every field (what overrides address)."""
        return _jsonable(dataclasses.asdict(self))

    def for_dataset(self, dataset: str) -> Protocol:
        """The protocol as it runs on ``dataset``: that dataset's settings applied, and
        the per-dataset sections consumed (so applying it again changes nothing, and
        command-line overrides made afterwards stay in force)."""
        if not self.datasets:
            return self
        settings = flatten_keys(self.datasets.get(dataset, {}))
        base = dataclasses.replace(self, datasets={})
        try:
            resolved, _ = apply_overrides(base, settings)
        except HarnessError as err:
            raise HarnessError(
                f"protocol '{self.name}', section datasets.{dataset}: {err}"
            ) from None
        return resolved

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def loss_args(self, loss_name: str) -> dict[str, Any]:
        return dict(self.loss.args.get(loss_name, {}))


#: (section, key) of fields left out of :meth:`Protocol.to_dict` at their default values.
_OPTIONAL_KEYS = (
    ("image", "multiscale_range"),
    ("splits", "validation_by_run_seed"),
    ("loss", "miners"),
)

#: ``"section.key"`` -> default of the keys left out of the canonical form
#: (:meth:`Protocol.to_dict`, what :func:`fingerprint` and the grids' cell keys hash) while
#: they hold that default. Each is a setting added after runs were recorded: a protocol
#: that leaves it at its default computes what it computed before, so it keeps the
#: fingerprint and cell keys of those runs; one that sets it gets new ones. Each default
#: here equals the field's (``tests/test_protocol.py`` checks it). A section left empty
#: is dropped with them.
_FINGERPRINT_OMITTED_AT_DEFAULT: dict[str, Any] = {
    "backbone.input_transform": True,
    "backbone.output_stride": 32,
    "sampling.classes_with_replacement": False,
    "sampling.images_with_replacement": False,
    "optimizer.clip_grad_norm": 0.0,
    "optimizer.loss_weight_decay": 0.0,
    "numerics.precision": "bf16",
    "image.train_resize": 0,
    "image.crop_ratio": (3 / 4, 4 / 3),
    "sampling.sampler": "classes",
    "sampling.loss_samplers": {},
}


@dataclass(frozen=True)
class Deviation:
    """A protocol field changed on the command line: named, recorded, fingerprinted."""

    field: str
    protocol_value: Any
    value: Any

    def __str__(self) -> str:
        return f"{self.field}: {self.protocol_value!r} -> {self.value!r}"


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise HarnessError(f"protocol key '{key}' = {shown(value)}: expected {expected}")


# --------------------------------------------------------------------------- parsing


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def flatten_keys(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"schedule": {"epochs": 100}}`` -> ``{"schedule.epochs": 100}`` (dicts that are
    protocol values, such as ``loss.args``, are reached key by key)."""
    out = {}
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten_keys(value, dotted))
        else:
            out[dotted] = value
    return out


@functools.cache
def _adapter() -> TypeAdapter[Protocol]:
    return TypeAdapter(Protocol)


@functools.cache
def _sections_schema() -> dict[str, Any]:
    return _adapter().json_schema()


def check_batch_fits(protocol: Protocol, dataset: str, *, images: int, classes: int) -> None:
    """The rule that needs the dataset's sizes, checked once its training split is known
    and before a run is tracked: a batch of ``classes_per_batch x samples_per_class``
    images must fit in the training images. A split with fewer classes than a batch asks
    for gives every batch all of them, with more images each and the same batch size
    (:func:`harness.engine.data.adapted_sampling`), so the classes are not refused."""
    s = protocol.sampling
    if s.batch_size > images:
        raise HarnessError(
            f"protocol key 'sampling.classes_per_batch' = {s.classes_per_batch}: expected classes_per_batch x "
            f"samples_per_class ({s.classes_per_batch} x {s.samples_per_class} = {s.batch_size}) <= the {images} "
            f"training images of {dataset} ({classes} classes)"
        )


#: ``[methods.<name>]`` of a method the schema was generated without (a plugin added or
#: installed since): any table; the harness checks its options when it reads the file.
_UNLISTED_METHOD = {
    "type": "object",
    "description": "Options of a method registered after this schema was "
    "generated; python -m harness schema lists them.",
}


def protocol_json_schema() -> dict[str, Any]:
    """The JSON Schema of a protocol file (what ``python -m harness schema`` prints and
    ``docs/protocol.schema.json`` holds): the sections' declared types, every registered
    method's options under ``[methods.<name>]`` (any table for another name, so that a copy
    generated earlier accepts a plugin added since) and the declared loss-argument ranges."""
    from harness.config.options import LossArguments, options_model
    from harness.methods import METHODS

    schema = json.loads(json.dumps(_sections_schema()))  # a copy: the cached one serves refusals
    schema.update(
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "dml-harness protocol",
            "description": "A fair protocol (protocols/<name>.toml); python -m harness schema prints this.",
        }
    )
    schema["required"] = []  # name defaults to the file's stem
    schema["properties"]["methods"] = {
        "type": "object",
        "additionalProperties": _UNLISTED_METHOD,
        "description": "Method options fixed by the protocol.",
        "properties": {name: options_model(name).model_json_schema() for name in METHODS.list()},
    }
    args = schema["$defs"]["LossSpec"]["properties"]["args"]
    args["additionalProperties"] = LossArguments.model_json_schema()
    return schema


def protocol_from_dict(data: dict[str, Any]) -> Protocol:
    """The protocol a run recorded (its canonical form, :meth:`Protocol.to_dict`), validated
    as a protocol file is."""
    return _validated(data)


def _validated(data: dict[str, Any]) -> Protocol:
    """The protocol of the table ``data``, checked against the declared schema: the
    annotations above (types, ranges, finiteness, unknown keys), the cross-key rules, and
    the options of every method it configures (run or not)."""
    try:
        protocol = _adapter().validate_python(data)
    except ValidationError as err:
        raise refusal(err, _sections_schema(), what="protocol key") from None
    from harness.methods import METHODS

    for method, options in protocol.methods.items():
        if method in METHODS:  # an unknown name is refused by name on loading
            check_option_values(method, options)
    check_loss_arg_values(protocol.loss.args)
    _check_component_names(protocol)
    return protocol


def _check_component_names(protocol: Protocol) -> None:
    """The backbone, miner, transforms and metrics a protocol names are registered ones:
    a misspelt name is refused when the protocol is read, not once the dataset has loaded."""
    from harness.components.backbones import BACKBONES, check_output_stride
    from harness.components.data.transforms import EVAL_TRANSFORMS, TRAIN_TRANSFORMS
    from harness.components.evaluation import parse_metrics
    from harness.components.losses import MINERS

    named = [
        ("backbone.name", protocol.backbone.name, BACKBONES.kind, BACKBONES.list()),
        ("miner.name", protocol.miner.name, MINERS.kind, ["none", *MINERS.list()]),
        ("image.train_transform", protocol.image.train_transform, "transform", TRAIN_TRANSFORMS),
        ("image.eval_transform", protocol.image.eval_transform, "transform", EVAL_TRANSFORMS),
    ]
    for key, name, kind, valid in named:
        if name not in valid:
            raise HarnessError(f"protocol key '{key}': {unknown_name(kind, name, valid)}")
    check_output_stride(protocol.backbone.name, protocol.backbone.output_stride)
    for key, metrics in (
        ("evaluation.metrics", protocol.evaluation.metrics),
        ("selection.metric", (protocol.selection.metric,)),
    ):
        try:
            parse_metrics(metrics)
        except HarnessError as err:
            raise HarnessError(f"protocol key '{key}': {err}") from None


def protocol_dir() -> Path:
    """The shipped protocols: ``protocols/`` of the source checkout (the source of truth),
    else the copy a wheel installs as package data (``harness/_protocols``, mapped from
    ``protocols/`` in pyproject.toml), else ``protocols/`` in the working directory."""
    package = Path(__file__).resolve().parents[1]  # harness/
    for folder in (package.parent / "protocols", package / "_protocols"):
        if (folder / "smoke.toml").is_file():  # not just any folder named protocols
            return folder
    return Path.cwd() / "protocols"


def list_protocols() -> list[str]:
    return sorted(p.stem for p in protocol_dir().glob("*.toml"))


def load_protocol(name_or_path: str | Path) -> Protocol:
    """Load a shipped protocol by name, or any ``.toml`` file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = protocol_dir() / f"{name_or_path}.toml"
        if not path.is_file():
            raise unknown_name("protocol", str(name_or_path), list_protocols())
    if not path.is_file():
        raise HarnessError(f"protocol file not found: {path}")
    try:
        data = tomllib.loads(read_text(path, "TOML"))
    except tomllib.TOMLDecodeError as err:
        raise HarnessError(f"malformed protocol file {path}: {err}") from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise HarnessError(f"malformed protocol file {path}: nested too deeply") from None
    data.setdefault("name", path.stem)
    protocol = _validated(data)
    for dataset, section in protocol.datasets.items():
        if not isinstance(section, dict) or {"name", "datasets"} & set(section):
            raise HarnessError(
                f"protocol key 'datasets.{dataset}' must be a table of protocol settings "
                f"(not name or datasets), got {section!r}"
            )
        protocol.for_dataset(dataset)  # unknown keys and bad values fail here, not mid-run
    _check_registered_names(protocol)
    return protocol


def _check_registered_names(protocol: Protocol) -> None:
    """Sections keyed by a method, loss or dataset name must name a registered one: a
    misspelt ``[methods.agroupng]`` would otherwise run with the defaults, unrecorded."""
    from harness.components.backbones import BACKBONES
    from harness.components.data import DATASETS
    from harness.components.losses import LOSSES, check_loss_args
    from harness.methods import METHODS

    check_names(
        protocol.deviations,
        methods=METHODS.list(),
        datasets=DATASETS.list(),
        backbones=BACKBONES.list(),
    )
    keyed: list[tuple[str, Any, Any]] = [
        ("methods", protocol.methods, METHODS),
        ("loss.args", protocol.loss.args, LOSSES),
        ("datasets", protocol.datasets, DATASETS),
        ("sampling.loss_samplers", protocol.sampling.loss_samplers, LOSSES),
        (
            "evaluation.recall_k",
            {k: v for k, v in protocol.evaluation.recall_k.items() if k != "default"},
            DATASETS,
        ),
    ]
    for key, section, registry in keyed:
        for name in section:
            if name not in registry:
                raise HarnessError(
                    f"protocol key '{key}.{name}': {unknown_name(registry.kind, name, registry.list())}"
                )
    for (
        loss,
        args,
    ) in protocol.loss.args.items():  # unknown arguments and reductions fail here, not mid-run
        check_loss_args(loss, args)
    _check_loss_miners(protocol)


def _check_loss_miners(protocol: Protocol) -> None:
    """``[loss.miners.<loss>]``: a registered loss, a ``name`` that is a registered miner
    (or ``"none"``: every pair or triplet of the batch), optional ``args``, nothing else."""
    from harness.components.losses import LOSSES, MINERS

    for loss, spec in protocol.loss.miners.items():
        key = f"loss.miners.{loss}"
        if loss not in LOSSES:
            raise HarnessError(
                f"protocol key '{key}': {unknown_name(LOSSES.kind, loss, LOSSES.list())}"
            )
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise HarnessError(
                f"protocol key '{key}' must be a table with a miner 'name', got {spec!r}"
            )
        extra = sorted(set(spec) - {"name", "args"})
        if extra:
            raise HarnessError(f"unknown protocol key '{key}.{extra[0]}' (expected name and args)")
        if spec["name"] != "none" and spec["name"] not in MINERS:
            raise HarnessError(
                f"protocol key '{key}.name': "
                f"{unknown_name(MINERS.kind, spec['name'], ['none', *MINERS.list()])}"
            )
        if not isinstance(spec.get("args", {}), dict):
            raise HarnessError(f"protocol key '{key}.args' must be a table, got {spec['args']!r}")


# ------------------------------------------------------------------------- overrides


def _parse_value(text: str) -> Any:
    """Parse an override value with TOML's own rules (``3``, ``1e-5``, ``[1, 2]``, ``"adam"``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string


#: The field's benchmark datasets: ``roth2020`` is their default protocol.
BENCHMARKS = ("cub200", "cars196", "sop", "inshop")


def default_protocol(dataset: str) -> str:
    """``smoke`` on the small CPU datasets, the field's standard (``roth2020``) on benchmarks."""
    return "roth2020" if dataset in BENCHMARKS else "smoke"


def _declare_loss_reduction(data: dict[str, Any], loss: str) -> bool:
    """``loss.args.<loss>.reduction`` may be set for any loss the protocol has arguments
    for, whether or not the file lists it (its current value: ``"pml"``, PML's own
    reduction). True when it was added here."""
    from harness.components.losses import PML_REDUCTION

    section = data["loss"]["args"].get(loss)
    if not isinstance(section, dict) or "reduction" in section:
        return False
    section["reduction"] = PML_REDUCTION
    return True


def _declare_method_option(data: dict[str, Any], method: str, option: str) -> bool:
    """``methods.<method>.<option>`` may set any option the method declares, whether or
    not the protocol file lists it (its current value: the method's default). True when
    the option was added here."""
    from harness.methods import METHODS

    options = METHODS.get(method).options()
    if option not in options:
        raise HarnessError(
            f"unknown option '{option}' for method '{method}' in --set methods.{method}.{option}; "
            f"valid: {', '.join(sorted(options)) or 'none'}"
        )
    section = data.setdefault("methods", {}).setdefault(method, {})
    if option in section:
        return False
    section[option] = _jsonable(options[option])
    return True


def _suggestion(path: list[str], key: str, table: dict[str, Any]) -> str:
    """`` (did you mean 'optimizer.lr_head'?)`` for a misspelt ``key`` of ``table`` (a close
    spelling, else the keys it begins), or ""."""
    names = [str(k) for k in table]
    close = difflib.get_close_matches(key, names, n=1) or [n for n in names if n.startswith(key)]
    if not close:
        return ""
    return " (did you mean " + " or ".join(f"'{'.'.join([*path, name])}'" for name in close) + "?)"


def apply_overrides(
    protocol: Protocol, overrides: dict[str, Any] | list[str]
) -> tuple[Protocol, tuple[Deviation, ...]]:
    """Return the protocol with ``{"schedule.epochs": 3}`` (or ``["schedule.epochs=3"]``) applied.

    Each changed field becomes a :class:`Deviation`; values equal to the
    protocol's are not deviations.
    """
    if isinstance(overrides, list):
        parsed = {}
        for item in overrides:
            if "=" not in item:
                raise HarnessError(f"override '{item}' must look like key.path=value")
            key, text = item.split("=", 1)
            parsed[key.strip()] = _parse_value(text.strip())
        overrides = parsed
    data = protocol._full_dict()
    deviations = []
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        if parts[0] == "deviations":
            raise HarnessError(
                f"'{dotted}' documents the protocol and is not a setting; edit the protocol file"
            )
        declared = (
            parts[0] == "methods" and len(parts) == 3 and _declare_method_option(data, *parts[1:])
        ) or (
            parts[:2] == ["loss", "args"]
            and len(parts) == 4
            and parts[3] == "reduction"
            and _declare_loss_reduction(data, parts[2])
        )
        for depth, part in enumerate(parts):
            if part not in node or (depth < len(parts) - 1 and not isinstance(node[part], dict)):
                raise HarnessError(
                    f"unknown protocol key '{dotted}'{_suggestion(parts[:depth], part, node)}"
                )
            if depth < len(parts) - 1:
                node = node[part]
        old = node[parts[-1]]
        node[parts[-1]] = value
        if _jsonable(value) != old:
            deviations.append(Deviation(dotted, old, value))
        elif declared:  # set to the default: the protocol (and its fingerprint) is unchanged
            del node[parts[-1]]
            if not node and parts[0] == "methods":
                del data["methods"][parts[1]]
    return _validated(data), tuple(deviations)


def fingerprint(
    protocol: Protocol,
    split_digest: str,
    *,
    loss: str = "",
    loss_args: Any = None,
    world_size: int = 1,
) -> str:
    """Hash of the canonical protocol, the resolved loss and the dataset split (16 hex chars).

    ``world_size``: processes that trained the run together (``torchrun``). The global
    batch is the protocol's either way, but the arithmetic differs (gathered embeddings,
    averaged gradients), so runs with other world sizes are not put side by side in one
    table. Absent from the payload at 1, so single-process fingerprints are unchanged.

    The ``[training]`` section (:class:`TrainingSpec`) is left out: it says how often the
    loop reads the device, which changes no number."""
    canonical = protocol.to_dict()
    canonical.pop("training", None)
    payload = json.dumps(
        {
            "protocol": canonical,
            "split": split_digest,
            "loss": loss,
            "loss_args": _jsonable(loss_args or {}),
            **({"world_size": int(world_size)} if world_size != 1 else {}),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
