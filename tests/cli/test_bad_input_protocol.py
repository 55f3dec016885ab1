"""Bad protocol settings, each refused with one clear line before any work
(:func:`tests.refusals.assert_refused`): values of protocol keys given with ``--set``,
method options, a batch larger than the training split, and protocol files."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_PROTOCOL
from tests.refusals import Refusal, assert_refused_in, small_synthetic, write_file

RUN = ("run", "--protocol", str(TINY_PROTOCOL))

#: The command line ({dir}: the case's folder, where ``prepare`` writes) and what its one
#: error line must say.
PROTOCOL_REFUSALS = [
    # Values of protocol keys (--set): type, range, finiteness, rules across keys.
    Refusal(
        (*RUN, "--set", "optimizer.lr_head=nan"),
        "protocol key 'optimizer.lr_head' = nan: expected a finite number > 0",
    ),
    Refusal(
        (*RUN, "--set", "training.sync_every=0"),
        "protocol key 'training.sync_every' = 0: expected an integer > 0",
    ),
    Refusal((*RUN, "--fast", "--deterministic"), "--deterministic and --fast exclude each other"),
    Refusal(
        (*RUN, "--register", ""),
        "run: argument --register: expected a model name without '/' or ':', got ''",
    ),
    Refusal(
        (*RUN, "--register", "team/embedder"),
        "expected a model name without '/' or ':', got 'team/embedder'",
    ),
    Refusal(
        (*RUN, "--set", "optimizer.lr_backbone=inf"),
        "'optimizer.lr_backbone' = inf: expected a finite number >= 0",
    ),
    Refusal(
        (*RUN, "--set", "optimizer.lr_head=-1e-4"),
        "'optimizer.lr_head' = -0.0001: expected a finite number > 0",
    ),
    Refusal(
        (*RUN, "--set", "optimizer.weight_decay=-0.1"),
        "'optimizer.weight_decay' = -0.1: expected a finite number >= 0",
    ),
    Refusal(
        (*RUN, "--set", "optimizer.momentum=1.5"),
        "'optimizer.momentum' = 1.5: expected a finite number >= 0 and < 1",
    ),
    Refusal(
        (*RUN, "--set", 'optimizer.name="adm"'),
        '\'optimizer.name\' = "adm": expected one of "adam", "adamw"',
    ),
    Refusal(
        (*RUN, "--set", "schedule.gamma=nan"),
        "'schedule.gamma' = nan: expected a finite number > 0",
    ),
    Refusal(
        (*RUN, "--set", "sampling.batches_per_epoch=-5"),
        "'sampling.batches_per_epoch' = -5: expected an integer >= 0",
    ),
    Refusal(
        (*RUN, "--set", "image.train_resize=50000"),
        "protocol key 'image.train_resize' = 50000: expected an integer >= 0 and <= 2048",
    ),
    Refusal(
        (*RUN, "--set", 'sampling.loss_samplers={nope="shuffle"}'),
        "protocol key 'sampling.loss_samplers': unknown loss 'nope'",
    ),
    Refusal(  # the tiny protocol's backbone, efficientnet_lite0: refused before the dataset loads
        (*RUN, "--set", "backbone.input_transform=false"),
        "protocol key 'backbone.input_transform' = false: backbone 'efficientnet_lite0' has no "
        "input transform of its own to skip (only googlenet has one)",
    ),
    Refusal(
        (*RUN, "--set", "sampling.samples_per_class=1"),
        "'sampling.samples_per_class' = 1: expected an integer >= 2",
    ),
    Refusal(
        (*RUN, "--set", "sampling.classes_per_batch=2.5"),
        "'sampling.classes_per_batch' = 2.5: expected an integer >= 2",
    ),
    Refusal(
        (*RUN, "--set", "selection.evaluate_every=0"),
        "'selection.evaluate_every' = 0: expected an integer >= 1",
    ),
    Refusal(
        (*RUN, "--set", "evaluation.batch_size=0"),
        "'evaluation.batch_size' = 0: expected an integer > 0",
    ),
    Refusal(
        (*RUN, "--set", "evaluation.metrics=[]"),
        "'evaluation.metrics' = []: expected a non-empty list of strings",
    ),
    Refusal(
        (*RUN, "--set", "splits.max_train_images_per_class=-1"),
        "'splits.max_train_images_per_class' = -1: expected an integer >= 0",
    ),
    Refusal(
        (*RUN, "--set", "splits.validation_classes=1.0"),
        "'splits.validation_classes' = 1.0: expected a finite number >= 0 and < 1",
    ),
    Refusal(
        (*RUN, "--set", "embedding.size=0"),
        "'embedding.size' = 0: expected an integer >= 2 and <= 8192",
    ),
    Refusal(
        (*RUN, "--set", 'image.size="big"'),
        "'image.size' = \"big\": expected an integer >= 32 and <= 1024",
    ),
    Refusal((*RUN, "--set", "image.resize=10"), "'image.resize' = 10: expected >= image.size (32)"),
    Refusal(
        (*RUN, "--set", "image.crop_scale=[0.5]"),
        "'image.crop_scale' = [0.5]: expected a list of 2 finite numbers",
    ),
    Refusal(
        (*RUN, "--set", "image.std=[0.5, 0.0, 0.5]"),
        "'image.std[1]' = 0.0: expected a finite number > 0",
    ),
    Refusal(
        (*RUN, "--set", "seeds=[]"),
        "protocol key 'seeds' = []: expected a non-empty list of integers >= 0",
    ),
    Refusal(
        (*RUN, "--set", "backbone.pretrained=1"),
        "'backbone.pretrained' = 1: expected true or false",
    ),
    Refusal(
        (*RUN, "--set", "loss.args.margin.margin=inf", "--protocol", "smoke"),
        "protocol key 'loss.args.margin.margin' = inf: expected a finite number",
    ),
    Refusal(
        ("run", "--set", "loss.args.proxy_anchor.alpha=inf"),
        "'loss.args.proxy_anchor.alpha' = inf: expected a finite number > 0",
    ),
    Refusal(
        (*RUN, "--set", "optimizer.lr=1"),
        "unknown protocol key 'optimizer.lr' (did you mean 'optimizer.lr_",
    ),
    Refusal(
        (*RUN, "--set", "optimiser.lr_head=1"),
        "unknown protocol key 'optimiser.lr_head' (did you mean 'optimizer'?)",
    ),
    Refusal((*RUN, "--set", "schedule.epochs.x=1"), "unknown protocol key 'schedule.epochs.x'"),
    Refusal(
        (*RUN, "--set", "optimizer.lr_head"),
        "override 'optimizer.lr_head' must look like key.path=value",
    ),
    Refusal((*RUN, "--set", "deviations.x.why=1"), "documents the protocol and is not a setting"),
    Refusal(
        ("run", "--protocol", "agrouping", "--set", 'loss.args.margin.reduction="mean"'),
        "loss 'margin': unknown reduction 'mean' valid: dgml, pml",
    ),
    Refusal(
        (*RUN, "--methods", "plain", "--set", "backbone.output_stride=8"),
        "protocol key 'backbone.output_stride' = 8: expected one of 16, 32",
    ),
    Refusal(
        (
            *RUN,
            "--methods",
            "plain",
            "--set",
            "backbone.name=googlenet",
            "--set",
            "backbone.output_stride=16",
        ),
        "protocol key 'backbone.output_stride' = 16: backbone 'googlenet' has only output stride 32",
    ),
    # Method options: declared types for every method the protocol configures, run or not.
    Refusal(
        (*RUN, "--methods", "plain", "--set", "methods.agrouping.diversity_weight=nan"),
        "protocol key 'methods.agrouping.diversity_weight' = nan: expected a finite number",
    ),
    Refusal(
        (*RUN, "--methods", "plain", "--set", 'methods.agrouping.groups="4"'),
        "protocol key 'methods.agrouping.groups' = \"4\": expected an integer",
    ),
    Refusal(
        (*RUN, "--methods", "plain", "--set", 'methods.diml.add_global="yes"'),
        "protocol key 'methods.diml.add_global' = \"yes\": expected true or false",
    ),
    Refusal(
        ("run", "--methods", "agrouping", "--set", "methods.agrouping.groups=3"),
        "method 'agrouping': groups must divide the embedding size 128, got 3",
    ),
    Refusal(
        ("run", "--methods", "diablo", "--set", "methods.diablo.entries=7"),
        "DIABLO entries (N) must be a positive divisor",
    ),
    Refusal(
        ("run", "--methods", "plain", "--set", "methods.plain.groups=2"),
        "unknown option 'groups' for method 'plain'",
    ),
    Refusal(
        ("run", "--methods", "diml_train", "--loss", "proxy_anchor"),
        "method 'diml_train' cannot train with loss 'proxy_anchor'",
    ),
    # The batch against the dataset's training split (read, then refused before a run is tracked).
    Refusal(
        (
            *RUN,
            "--methods",
            "plain",
            "--data-root",
            "{dir}",
            "--set",
            "sampling.classes_per_batch=1000",
        ),
        "'sampling.classes_per_batch' = 1000: expected classes_per_batch x samples_per_class (1000 x 2 = 2000) "
        "<= the 24 training images of synthetic (6 classes)",
        small_synthetic,
    ),
    # Protocol files: a missing file, a folder, a syntax error, bad values, misspelt names.
    Refusal(("run", "--protocol", "{dir}/none.toml"), "protocol file not found"),
    Refusal(
        ("run", "--protocol", "{dir}/folder.toml"),
        "protocol file not found",
        lambda folder: (folder / "folder.toml").mkdir(),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "malformed protocol file",
        write_file("p.toml", "[optimizer\nlr_head = 1\n"),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "protocol key 'optimizer.lr_head' = \"fast\": expected a finite number > 0",
        write_file("p.toml", '[optimizer]\nlr_head = "fast"\n'),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "protocol key 'optimizer.lr_head' = nan",
        write_file("p.toml", "[optimizer]\nlr_head = nan\n"),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "protocol key 'backbone' = 3: expected a table",
        write_file("p.toml", "backbone = 3\n"),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "protocol key 'evaluation.recall_k.default' = []: expected a non-empty list",
        write_file("p.toml", "[evaluation.recall_k]\ndefault = []\n"),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "unknown protocol key 'sampling.classes_per_bach' (did you mean 'classes_per_batch'?)",
        write_file("p.toml", "[sampling]\nclasses_per_bach = 8\n"),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "protocol key 'methods.agroupng': unknown method 'agroupng'; did you mean 'agrouping'?",
        write_file("p.toml", "[methods.agroupng]\ngroups = 4\n"),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "protocol key 'loss.args.margn': unknown loss 'margn'; did you mean 'margin'?",
        write_file("p.toml", "[loss.args.margn]\nmargin = 0.1\n"),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "loss 'margin': unknown reduction 'dgm'; did you mean 'dgml'? valid: dgml, pml",
        write_file("p.toml", '[loss.args.margin]\nreduction = "dgm"\n'),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "protocol key 'loss.miners.margin' must be a table with a miner 'name'",
        write_file("p.toml", "[loss.miners.margin]\n"),
    ),
    Refusal(
        ("run", "--protocol", "{dir}/p.toml"),
        "section datasets.sop: protocol key 'schedule.epochs' = -1",
        write_file("p.toml", "[datasets.sop.schedule]\nepochs = -1\n"),
    ),
]


@pytest.mark.parametrize("case", PROTOCOL_REFUSALS, ids=str)
def test_every_bad_input_is_refused_with_one_line(
    case, workdir, data_root, tracking_dir, capsys, tmp_path_factory
):
    """No case reads the synthetic dataset (each is refused first), so data_root stays as it was."""
    folder = tmp_path_factory.mktemp("input")
    assert_refused_in(
        case, folder, tracking_dir, capsys, watched=[workdir, data_root, folder, tracking_dir]
    )
