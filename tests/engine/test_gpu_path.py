"""The GPU-facing parts of training, checked on the CPU: per-image augmentation seeds
(the same crops whatever the workers, their persistence and a resume), the deferred
non-finite check naming the right batch, ``--deterministic`` repeatability and its record,
and the autocast choice."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from harness.base.device import amp_dtype, amp_name
from harness.cli.main import main
from harness.components.data.sampling import ClassBalancedBatchSampler, TransformedImages
from harness.components.data.transforms import build_transform
from harness.config.protocol_files import load_protocol
from harness.methods import METHODS, HeadOutput
from harness.methods.base import MethodEntry
from harness.methods.plain import PlainHead


class _Images:
    """An image set of 24 random 40 x 30 RGB images, 6 classes."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.pixels = rng.integers(0, 256, (24, 30, 40, 3), dtype=np.uint8)
        self.labels = np.repeat(np.arange(6), 4)

    def __len__(self):
        return len(self.labels)

    def read(self, index):
        return Image.fromarray(self.pixels[index])


def _epochs(workers: int, epochs=(0, 1, 2), *, persistent: bool = True) -> list[torch.Tensor]:
    spec = load_protocol("smoke").image
    data = TransformedImages(_Images(), build_transform(spec, train=True))
    sampler = ClassBalancedBatchSampler(
        data.images.labels,
        classes_per_batch=3,
        samples_per_class=2,
        batches_per_epoch=3,
        seed=7,
        sample_seeds=True,
    )
    loader = DataLoader(
        data,
        batch_sampler=sampler,
        num_workers=workers,
        persistent_workers=persistent and workers > 0,
    )
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        torch.manual_seed(epoch)  # the loop's own stream must not matter
        out.append(torch.cat([images for images, _, _ in loader]))
    return out


def test_augmentation_depends_on_seed_epoch_and_position_only():
    """In-process, persistent workers, and a loader built fresh at epoch 2 (a resume) draw
    the same crops and flips; epochs differ from each other."""
    in_process = _epochs(0)
    persistent = _epochs(2)
    resumed = _epochs(2, epochs=(2,), persistent=False)
    for a, b in zip(in_process, persistent, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(in_process[2], resumed[0])
    assert not torch.equal(in_process[0], in_process[1])


def test_a_seeded_item_leaves_the_callers_random_stream_alone():
    data = TransformedImages(_Images(), build_transform(load_protocol("smoke").image, train=True))
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    first = data[(5, 123)][0]
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(data[(5, 123)][0], first)


class _NanFromBatchTwo(PlainHead):
    """A plain head whose loss is NaN from its second training step on (test only). Each
    model counts its own steps: the estimate's warm-up trains a model of its own first."""

    def loss_terms(self, output: HeadOutput, batch):
        self.calls = getattr(self, "calls", 0) + 1
        loss = batch.metric_loss(output.embedding, batch.labels)
        return {"metric": loss * (float("nan") if self.calls >= 2 else 1.0)}


def test_the_deferred_check_names_the_first_non_finite_batch(workdir, tiny_protocol, capsys):
    with METHODS.temporarily("nan2-test", MethodEntry("nan2-test", _NanFromBatchTwo, {})):
        assert main(["run", "--methods", "nan2-test", "--protocol", str(tiny_protocol)]) == 2
    assert "error: loss is nan at epoch 1, batch 2 " in capsys.readouterr().err


def test_deterministic_runs_repeat_and_are_recorded(workdir, tiny_protocol):
    """Two --deterministic runs (every op's deterministic kernel, an error where there is none)
    give identical metrics on the CPU; on CUDA this is untested here."""
    records = []
    try:
        for name in ("a", "b"):
            out = workdir / f"{name}.json"
            assert (
                main(
                    [
                        "run",
                        "--methods",
                        "plain",
                        "--protocol",
                        str(tiny_protocol),
                        "--epochs",
                        "1",
                        "--deterministic",
                        "--checkpoint-root",
                        str(workdir / name),
                        "--json",
                        str(out),
                    ]
                )
                == 0
            )
            records.append(json.loads(out.read_text())[0])
    finally:
        torch.use_deterministic_algorithms(True, warn_only=True)  # the harness's CPU default
    assert records[0]["metrics"] == records[1]["metrics"] and records[0]["deterministic"] is True
    run = mlflow.MlflowClient().get_run(records[0]["mlflow_run_id"])
    assert run.data.tags["deterministic"] == "True" and run.data.params["deterministic"] == "True"
    assert run.data.tags["amp"] == "off" and run.data.tags["world_size"] == "1"


def test_autocast_is_bf16_where_supported_and_off_on_cpu():
    assert amp_dtype(torch.device("cpu")) is None and amp_name(torch.device("cpu")) == "off"
    if torch.cuda.is_available():
        expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        assert amp_dtype(torch.device("cuda")) == expected


def test_default_workers_overlap_loading_only_where_a_core_is_free(monkeypatch):
    """One loader process on CPU with 2+ cores per training process (its batch is prepared
    during the step), none when torchrun already gives each process under 2 cores, 4 on CUDA."""
    from harness.engine.run.runtime import default_workers

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert default_workers(torch.device("cpu")) == 1
    assert default_workers(torch.device("cpu"), world_size=2) == 0
    assert default_workers(torch.device("cuda")) == 4
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert default_workers(torch.device("cpu")) == 0


def test_fast_turns_on_autotuning_and_any_kernel_and_excludes_deterministic(workdir, capsys):
    from harness.base.device import configure_determinism

    try:
        configure_determinism(False, fast=True)
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
        configure_determinism(False)  # the default: deterministic kernels where they exist
        assert (
            torch.are_deterministic_algorithms_enabled()
            and torch.is_deterministic_algorithms_warn_only_enabled()
        )
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    finally:
        configure_determinism(False)
    assert main(["run", "--methods", "plain", "--fast", "--deterministic"]) == 2
    assert capsys.readouterr().err.strip() == "error: --deterministic and --fast exclude each other"


@pytest.mark.slow
def test_a_compiled_fast_run_trains_and_says_so(workdir, tiny_protocol):
    """``--compile`` (inductor on the CPU; the tiny protocol's indexed miner: the step with
    graph breaks) trains to the eager run's numbers within float tolerance; ``--fast`` and
    ``--compile`` are in the run's tags."""
    from harness.base.device import configure_determinism

    records = {}
    try:
        for name, flags in (("eager", []), ("compiled", ["--compile", "--fast"])):
            out = workdir / f"{name}.json"
            assert (
                main(
                    [
                        "run",
                        "--methods",
                        "plain",
                        "--protocol",
                        str(tiny_protocol),
                        "--epochs",
                        "1",
                        "--checkpoint-root",
                        str(workdir / name),
                        "--json",
                        str(out),
                        *flags,
                    ]
                )
                == 0
            )
            records[name] = json.loads(out.read_text())[0]
    finally:
        configure_determinism(False)
    run = mlflow.MlflowClient().get_run(records["compiled"]["mlflow_run_id"])
    assert run.data.tags["compile"] == "True" and run.data.tags["fast"] == "True"
    eager, compiled = records["eager"]["metrics"], records["compiled"]["metrics"]
    assert eager.keys() == compiled.keys()
    for key in ("precision_at_1", "mean_average_precision_at_r"):
        assert compiled[key] == pytest.approx(eager[key], abs=0.05)


def _compiled_run(workdir, tiny_protocol, capsys, *flags: str) -> dict:
    out = workdir / "compiled.json"
    code = main(
        [
            "run",
            "--methods",
            "plain",
            "--protocol",
            str(tiny_protocol),
            "--epochs",
            "1",
            "--set",
            'miner.name="distance_weighted_fixed"',
            "--json",
            str(out),
            *flags,
        ]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    return json.loads(out.read_text())[0]


@pytest.mark.slow
def test_a_step_with_a_fixed_shape_miner_compiles_whole_and_trains(workdir, tiny_protocol, capsys):
    """``--compile`` with a fixed-shape miner: one graph (``fullgraph=True``, so no break),
    inductor on the CPU; no line about graph breaks; recorded."""
    record = _compiled_run(workdir, tiny_protocol, capsys, "--compile")
    assert "graph breaks" not in capsys.readouterr().err  # the run's progress lines
    assert record["compile"] is True and record["cuda_graphs"] is False
    assert 0 <= record["metrics"]["precision_at_1"] <= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_compiled_step_on_a_gpu(workdir, tiny_protocol, capsys):
    from torch._dynamo.utils import counters

    counters.clear()
    record = _compiled_run(workdir, tiny_protocol, capsys, "--device", "cuda", "--cuda-graphs")
    assert counters["inductor"]["cudagraph_skips"] == 0  # replayed, not only compiled
    assert "without a CUDA graph" not in capsys.readouterr().err
    assert record["compile"] is True and record["cuda_graphs"] is True
    run = mlflow.MlflowClient().get_run(record["mlflow_run_id"])
    assert run.data.tags["cuda_graphs"] == "True"
