"""Refusals of ``sweep --executor``, ``--status`` and ``--cancel``: each is one ``error:`` line,
exit status 2, no traceback, nothing written and nothing submitted
(:func:`tests.refusals.assert_refused`). Slurm's answers come from stand-ins of its
commands (:mod:`tests.slurm_fakes`), or from no Slurm at all; ``tests/engine/test_slurm.py``
checks the same refusals against a real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import slurm_fakes
from tests.refusals import Refusal, assert_refused

TINY = str(Path(__file__).parents[1] / "protocols" / "tiny.toml")
GRID = str(Path(__file__).parents[1] / "grids" / "tiny.toml")
SLURM = ("sweep", "--grid", GRID, "--executor", "slurm")
LOCAL = ("sweep", "--grid", GRID, "--executor", "local")


def grid_with(table: str, *, replace_name: bool = False):
    """``slurm-grid.toml``: the tiny grid with ``table`` (an ``[executor.slurm]``) added,
    or (``replace_name``) with ``table`` as its ``name = ...`` line."""

    def prepare(where: Path) -> None:
        text = Path(GRID).read_text().replace("../protocols/tiny.toml", TINY)
        if replace_name:
            text = text.replace('name = "tiny"', table)
        else:
            text += "\n" + table + "\n"
        (where / "slurm-grid.toml").write_text(text)

    return prepare


#: With Slurm's stand-ins on PATH.
CASES = [
    Refusal(
        (*SLURM, "--partition", "nope"), "--partition nope: Slurm says: Partition nope not found"
    ),
    Refusal(
        (*SLURM, "--cpus-per-task", "64"),
        "--cpus-per-task 64 exceeds partition debug: its largest node has 2 CPUs",
    ),
    Refusal(
        (*SLURM, "--mem", "16G"), "--mem 16G exceeds partition debug: its largest node has 1000 MB"
    ),
    Refusal(
        (*SLURM, "--gpus-per-task", "1"),
        "--gpus-per-task 1 exceeds partition debug: its largest node has 0 GPUs",
    ),
    Refusal(
        (*SLURM, "--partition", "gpu", "--gpus-per-task", "4"),
        "--gpus-per-task 4 exceeds partition gpu: its largest node has 2 GPUs",
    ),
    Refusal(
        (*SLURM, "--time", "2:00:00"),
        "--time 2:00:00 exceeds partition debug's time limit of 60 minutes",
    ),
    Refusal(
        (*SLURM, "--account", "nobody"),
        "Slurm refused the sweep's jobs: Batch job submission failed: Invalid account",
    ),
    Refusal(
        ("sweep", "--grid", "slurm-grid.toml", "--executor", "slurm"),
        "--cpus-per-task 16 exceeds partition debug",
        grid_with("[executor.slurm]\ncpus_per_task = 16"),
    ),
    Refusal(
        ("sweep", "--grid", "slurm-grid.toml", "--executor", "slurm", "--partition", "nope"),
        "Partition nope not found",
        grid_with('[executor.slurm]\npartition = "gpu"'),
    ),
    # --- the options themselves (no Slurm asked)
    Refusal((*SLURM, "--partitoin", "gpu"), "unrecognized arguments: --partitoin gpu"),
    Refusal(
        ("sweep", "--grid", GRID, "--executor", "pbs"), "argument --executor: invalid choice: 'pbs'"
    ),
    Refusal((*SLURM, "--time", "4h"), "argument --time: expected a Slurm time limit like 90"),
    Refusal((*SLURM, "--time", "0"), "argument --time: expected a Slurm time limit"),
    Refusal((*SLURM, "--mem", "16 GB"), "argument --mem: expected a memory size like 16G"),
    Refusal(
        (*SLURM, "--gpus-per-task", "-1"), "argument --gpus-per-task: expected an integer >= 0"
    ),
    Refusal(
        (*SLURM, "--array-parallelism", "0"),
        "argument --array-parallelism: expected an integer >= 1",
    ),
    Refusal(
        ("sweep", "--grid", GRID, "--partition", "gpu"), "--partition applies to --executor slurm"
    ),
    Refusal(("sweep", "--grid", GRID, "--wait"), "--wait applies to --executor slurm or local"),
    Refusal(
        (*LOCAL, "--partition", "gpu"),
        "--partition is a Slurm resource; --executor local does not use it",
    ),
    Refusal((*LOCAL, "--account", "lab"), "--account is a Slurm resource"),
    Refusal(
        ("sweep", "--status", GRID, "--grid", GRID),
        "argument --grid: not allowed with argument --status",
    ),
    Refusal(
        ("sweep", "--cancel", GRID), "grid tiny: no job was submitted for it (nothing to cancel)"
    ),
    Refusal(
        (*LOCAL, "--gpus-per-task", "2"),  # this machine has fewer than 2 GPUs
        "--gpus-per-task 2: the local executor runs each task on this machine, which has",
    ),
    Refusal(
        ("sweep", "--grid", "slurm-grid.toml", "--executor", "local"),
        "grid key 'name' = \"../../escaped\": expected a name of letters, digits, '.', '_' and '-'",
        grid_with('name = "../../escaped"', replace_name=True),
    ),
    Refusal(("sweep", "--status", "nosuch-grid"), "unknown grid 'nosuch-grid'"),
    Refusal(
        ("sweep", "--grid", "slurm-grid.toml", "--executor", "slurm"),
        "unknown grid key 'executor.slurm.gpu_per_task' (did you mean 'gpus_per_task'?)",
        grid_with("[executor.slurm]\ngpu_per_task = 2"),
    ),
    Refusal(
        ("sweep", "--grid", "slurm-grid.toml"),
        'grid key \'executor.slurm.time\' = "4 hours": expected a string like "90"',
        grid_with('[executor.slurm]\ntime = "4 hours"'),
    ),
    Refusal(
        ("sweep", "--grid", "slurm-grid.toml"),
        "grid key 'executor.slurm.mem' = 16: expected a string like \"16G\"",
        grid_with("[executor.slurm]\nmem = 16"),
    ),
    Refusal(
        ("sweep", "--grid", "slurm-grid.toml"),
        "unknown grid key 'executor.pbs'",
        grid_with("[executor.pbs]\nqueue = 'x'"),
    ),
]


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory) -> Path:
    return slurm_fakes.install(tmp_path_factory.mktemp("slurm"))


def _case_id(case: Refusal) -> str:
    return " ".join(case.argv).replace(GRID, "tiny-grid.toml")[:100]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_refused(case, workdir, data_root, capsys, monkeypatch, fake_bin):
    monkeypatch.setenv("PATH", f"{fake_bin}:{Path('/usr/bin')}:{Path('/bin')}")
    if case.prepare is not None:
        case.prepare(workdir)
    assert_refused(list(case.argv), case.match, capsys, [workdir, data_root])


def test_no_slurm_on_this_machine_is_refused_before_anything(
    workdir, data_root, capsys, monkeypatch, tmp_path_factory
):
    """``sbatch`` not found: one line saying so and what to do instead."""
    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("empty-path")))
    line = assert_refused(
        list(SLURM), "no Slurm on this machine (sbatch", capsys, [workdir, data_root]
    )
    assert "use --executor local" in line
