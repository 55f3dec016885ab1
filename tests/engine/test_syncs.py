"""A training step never waits for the device: proved on the CPU for every method.

On a GPU the host queues a step's kernels and runs ahead unless something reads the
device: a scalar read (``.item()``, ``float(t)``, ``bool(t)``), a copy to the host, or an
op whose output shape depends on the data. :class:`~harness.base.syncs.SyncCounter`
counts them on any device, so K steps of the engine's real epoch loop
(:meth:`~harness.engine.run.trainer.Trainer.train_epoch`) are counted here, in float32 and under
bfloat16 autocast (the mixed-precision path of every method, run on the CPU).

The loss values are read once per ``[training] sync_every`` steps (one ``.tolist()`` per
flush). Mining is counted apart: in float32 the protocol's distance-weighted sampling runs
in its fixed shape (``distance_weighted_fixed``, the losses taking its mask), and its
section must be empty too; under bfloat16 it runs as PML's indexed miner, whose
data-dependent shapes are allowed there. A method whose step works on the host by its design
(SAM's greedy tuple selection, ``selection="host"``) says why in
:meth:`~harness.methods.HostReader.step_host_reads`
and may make one transfer per step, no more: its random draws come from torch's global
generator, the CPU one, and are counted apart too (on a GPU they never touch the device;
here every tensor stands for a device tensor, so they would look like device reads).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from harness.base.errors import HarnessError
from harness.base.syncs import SyncCounter
from harness.components.losses import MinedTriplets
from harness.config.protocol_files import load_protocol
from harness.engine.run.data import prepare_splits
from harness.engine.run.recorder import InMemoryRecorder, StepFlush
from harness.engine.run.run_config import RunConfig
from harness.engine.run.trainer import Trainer
from harness.methods import HostReader, list_methods, sam_tuples
from tests.conftest import TINY_PROTOCOL

STEPS, SYNC_EVERY = 4, 2
#: Options under which a method's step works on the host by design, with one transfer per
#: step (each says why in step_host_reads): SAM's greedy selection on the host.
ONE_TRANSFER_PER_STEP = {"sam": {"selection": "host"}, "sam_quadruplet": {"selection": "host"}}
#: Host-only work inside a step, each counted in a section of its own: SAM's draws from
#: torch's global (CPU) generator, and its host selection's read of which fixed-shape
#: tuples are valid (``MinedTriplets.compact``), which no other method may make.
HOST_SECTIONS = {
    (sam_tuples, "random_order"): "host draws",
    (sam_tuples, "random_index"): "host draws",
    (MinedTriplets, "compact"): "compaction",
}


@pytest.fixture(scope="module")
def protocol():
    p = load_protocol(TINY_PROTOCOL)
    return dataclasses.replace(
        p,
        sampling=dataclasses.replace(p.sampling, batches_per_epoch=STEPS),
        training=dataclasses.replace(p.training, sync_every=SYNC_EVERY),
    )


@pytest.fixture(scope="module")
def splits(protocol):
    return prepare_splits(protocol, "synthetic", None, seed=0)


def _count_steps(
    protocol, splits, name: str, monkeypatch, options=None, autocast=None
) -> tuple[SyncCounter, list[StepFlush], object]:
    """One epoch of STEPS steps of ``name`` (with method ``options``) under the counter, its
    batches read beforehand (the loader decodes and augments on the host, by design)."""
    cfg = RunConfig.build(
        protocol,
        method=name,
        dataset="synthetic",
        loss=protocol.loss.name,
        seed=0,
        method_options=options,
    )
    recorder = InMemoryRecorder()
    trainer = Trainer.from_config(cfg, splits, recorder=recorder)
    trainer.step.autocast_dtype = autocast  # the CPU's bfloat16 autocast stands for the GPU's
    trainer.batches.loader = list(trainer.batches.loader)
    with SyncCounter() as counter:
        metric_loss = trainer.step.metric_loss  # this trainer's part: its mining counted apart
        metric_loss.mine = _in_section(counter, "mining", metric_loss.mine)
        for (owner, name), section in HOST_SECTIONS.items():
            # Work deep inside a method's step that no part passed in reaches: counted apart.
            monkeypatch.setattr(owner, name, _in_section(counter, section, getattr(owner, name)))
        trainer.train_epoch(0)
    return counter, recorder.flushes, trainer.model.head


def _in_section(counter: SyncCounter, section: str, function):
    def counted(*args, **kwargs):
        with counter.section(section):
            return function(*args, **kwargs)

    return counted


def _cases() -> list[tuple[str, str, str]]:
    """Every method in float32 and under bfloat16 autocast, DIABLO's variants but the first
    in float32 only: they run the same modules wired at other points, and CPU bfloat16
    (emulated) takes 4-10 s for each. SAM's host selection too (``"host"``), in float32."""
    first_diablo = next(n for n in list_methods() if n.startswith("diablo"))
    return [
        (name, precision, "default")
        for name in list_methods()
        for precision in ("float32", "bfloat16")
        if precision == "float32" or not name.startswith("diablo") or name == first_diablo
    ] + [(name, "float32", "host") for name in ONE_TRANSFER_PER_STEP]


@pytest.mark.parametrize("name,precision,options", _cases())
def test_training_steps_read_the_device_once_per_flush(
    protocol, splits, name, precision, options, monkeypatch
):
    if (
        precision == "float32"
    ):  # with the fixed-shape form of the protocol's distance-weighted sampling
        protocol = dataclasses.replace(
            protocol, miner=dataclasses.replace(protocol.miner, name="distance_weighted_fixed")
        )
    on_host = options == "host"
    method_options = ONE_TRANSFER_PER_STEP[name] if on_host else None
    autocast = torch.bfloat16 if precision == "bfloat16" else None
    counter, flushes, head = _count_steps(
        protocol, splits, name, monkeypatch, method_options, autocast
    )
    mining = counter.sections["mining"]
    if precision == "float32":  # the miner and the losses over its mask: no data-dependent shape
        assert mining["shape_dependent"] == mining["scalar_reads"] == mining["device_to_host"] == 0

    assert [f.global_step for f in flushes] == [2, 4]
    assert all(
        len(f.step_losses) == SYNC_EVERY and all(map(math.isfinite, f.step_losses)) for f in flushes
    )
    assert counter.shape_dependent == 0, dict(counter.ops)
    reason = head.step_host_reads() if isinstance(head, HostReader) else ""
    # No scalar read of the device inside a step, and one transfer per flush ...
    assert counter.scalar_reads == 0
    if on_host:
        assert reason, f"{name} works on the host: step_host_reads must say why"
        # ... plus one per step (every step here has mined candidates to select from).
        assert counter.device_to_host == STEPS + len(flushes)
        draws = counter.sections["host draws"]
        assert draws["scalar_reads"] + draws["device_to_host"] > 0  # the draws were seen, apart
    else:
        assert not reason
        assert counter.device_to_host == len(flushes) == STEPS // SYNC_EVERY
        assert "compaction" not in counter.sections  # the losses took the mask


def test_the_counter_sees_each_kind_of_wait():
    x = torch.arange(6.0)
    with SyncCounter() as counter:
        float(x.sum())
        bool(x[0] > 1)
        x.tolist()
        x[x > 2]
        torch.nonzero(x)
        with counter.section("mining"):
            x.unique()
    assert (counter.scalar_reads, counter.device_to_host, counter.shape_dependent) == (2, 1, 2)
    assert counter.sections["mining"]["shape_dependent"] == 1
    assert torch.Tensor.tolist is not None and x.tolist() == [
        0.0,
        1.0,
        2.0,
        3.0,
        4.0,
        5.0,
    ]  # restored


def test_flushes_log_loss_and_lr_per_global_step_and_leave_the_fingerprint(workdir, tiny_protocol):
    """``[training] sync_every`` changes when the loop reads the device, not a number: the
    fingerprint and the epoch metrics are the default run's; ``train/loss`` and ``train/lr``
    have every step (one epoch of 3), however the flushes split them."""
    import json

    import mlflow

    from harness.cli.main import main

    records = {}
    for every in ("50", "2"):
        out = workdir / f"{every}.json"
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
                    "--set",
                    f"training.sync_every={every}",
                    "--checkpoint-root",
                    str(workdir / every),
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        records[every] = json.loads(out.read_text())[0]
    assert records["2"]["fingerprint"] == records["50"]["fingerprint"]
    assert records["2"]["metrics"] == records["50"]["metrics"]
    client = mlflow.MlflowClient()
    histories = {
        every: {
            k: sorted((m.step, m.value) for m in client.get_metric_history(r["mlflow_run_id"], k))
            for k in ("train/loss", "train/lr", "train/epoch_loss")
        }
        for every, r in records.items()
    }
    assert [s for s, _ in histories["2"]["train/loss"]] == [1, 2, 3]
    assert histories["2"]["train/loss"] == histories["50"]["train/loss"]
    assert histories["2"]["train/epoch_loss"] == histories["50"]["train/epoch_loss"]
    assert [s for s, _ in histories["2"]["train/lr"]] == [1, 2, 3]
    assert histories["2"]["train/lr"] == histories["50"]["train/lr"]
    assert all(v == 1e-4 for _, v in histories["2"]["train/lr"])  # the backbone group's lr


def test_a_non_finite_loss_is_named_by_its_batch_across_flushes(protocol, splits):
    """The third step's loss is NaN: the first flush (steps 1-2) passes, the second names batch 3."""
    cfg = RunConfig.build(
        protocol, method="plain", dataset="synthetic", loss=protocol.loss.name, seed=0
    )
    recorder = InMemoryRecorder()
    trainer = Trainer.from_config(cfg, splits, recorder=recorder)
    step = trainer.step

    def nan_from_third(images, labels, seed, epoch, index):
        loss, terms = step(images, labels, seed, epoch, index)
        return (loss * float("nan"), terms) if index == 2 else (loss, terms)

    trainer.step = nan_from_third  # the trainer's step, a part it is made of
    with pytest.raises(HarnessError, match=r"loss is nan at epoch 1, batch 3 "):
        trainer.train_epoch(0)
    assert [f.global_step for f in recorder.flushes] == [2]
