"""The Slurm commands a sweep runs besides submitit's submission: the checks that come
before anything is submitted (Slurm installed, the partition known, the resources within
its limits, and Slurm's own dry run), and the reads and cancels of ``sweep --status`` and
``sweep --cancel`` (``squeue``, ``scancel``).

Each check that fails is one error line; where Slurm refused, the line quotes Slurm's own
message, since it names the policy (an account, a QOS, a partition) that the harness
cannot see. The commands honour ``SLURM_CONF`` as every Slurm client does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from harness.base.errors import HarnessError
from harness.config.executor import megabytes, slurm_minutes

__all__ = [
    "SlurmOptions",
    "require_slurm",
    "PartitionLimits",
    "partition_limits",
    "check_resources",
    "test_submission",
    "queue_states",
    "cancel_jobs",
    "CLIENTS",
]

#: The client commands a sweep on Slurm runs (submitit submits with sbatch and srun).
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "sinfo", "scontrol")
#: Seconds a Slurm client command has to answer.
TIMEOUT = 60


@dataclass(frozen=True)
class SlurmOptions:
    """What each array task asks for (``--partition`` ... ``--qos``, or the grid's
    ``[executor.slurm]``); None: Slurm's default, or the partition's for ``time``."""

    partition: str | None = None
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    array_parallelism: int | None = None
    account: str | None = None
    qos: str | None = None

    def sbatch_options(self) -> list[str]:
        """These resources as ``sbatch`` options (for its ``--test-only`` dry run)."""
        out = []
        for name in ("partition", "gpus_per_task", "cpus_per_task", "mem", "time", "account"):
            value = getattr(self, name)
            if value is not None and not (name == "gpus_per_task" and value == 0):
                out.append(f"--{name.replace('_', '-')}={value}")
        if self.qos is not None:
            out.append(f"--qos={self.qos}")
        return out


def require_slurm() -> None:
    """Refuse when this machine has no Slurm client to submit with."""
    missing = [name for name in CLIENTS if shutil.which(name) is None]
    if missing:
        raise HarnessError(
            f"--executor slurm: no Slurm on this machine ({', '.join(missing)} not found on PATH); "
            f"submit from a cluster's login node, or use --executor local"
        )


def _slurm(*command: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            list(command), capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise HarnessError(
            f"Slurm did not answer `{' '.join(command)}` within {TIMEOUT} s (is slurmctld up?)"
        ) from None
    except OSError as err:
        raise HarnessError(f"cannot run {command[0]}: {err.strerror or err}") from None


def _message(done: subprocess.CompletedProcess) -> str:
    """Slurm's error lines as one: ``sbatch: error: `` prefixes dropped, joined by ``; ``."""
    lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines()]
    lines = [re.sub(r"^\w+: error: *", "", line) for line in lines if line]
    return "; ".join(dict.fromkeys(lines)) or f"exit status {done.returncode}"


@dataclass(frozen=True)
class PartitionLimits:
    """What the largest node of a partition offers, and its time limit (None: none)."""

    name: str
    cpus: int
    memory_mb: int
    gpus: int
    minutes: float | None


def _gpus(gres: str) -> int:
    """GPUs in a node's ``%G`` (``gpu:4``, ``gpu:a100:4(S:0-1)``, ``(null)``)."""
    total = 0
    for item in gres.split(","):
        match = re.match(r"gpu(?::[^:(,]+)?:(\d+)", item.strip())
        if match:
            total += int(match.group(1))
    return total


def _minutes(limit: str) -> float | None:
    """A partition's time limit as sinfo prints it (``infinite``, ``1-00:00:00``)."""
    if limit in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    return slurm_minutes(limit)


def partition_limits(partition: str | None) -> PartitionLimits:
    """The partition's limits from ``sinfo`` (the default partition when None); an
    unknown partition is refused with Slurm's own message."""
    if partition is not None:
        done = _slurm("scontrol", "show", "partition", partition, "--oneliner")
        if done.returncode != 0:
            raise HarnessError(f"--partition {partition}: Slurm says: {_message(done)}")
    args = ["-p", partition] if partition else []
    done = _slurm("sinfo", "--noheader", *args, "--format=%P|%l|%c|%m|%G")
    if done.returncode != 0:
        raise HarnessError(f"sinfo failed: Slurm says: {_message(done)}")
    rows = [line.split("|") for line in done.stdout.splitlines() if line.count("|") == 4]
    if partition is None:
        rows = [r for r in rows if r[0].endswith("*")]
    if not rows:
        raise HarnessError(
            f"--partition {partition}: no node in it"
            if partition
            else "--executor slurm: the cluster has no default partition; give --partition"
        )
    return PartitionLimits(
        name=rows[0][0].rstrip("*"),
        cpus=max(int(r[2].rstrip("+")) for r in rows),
        memory_mb=max(int(r[3].rstrip("+")) for r in rows),
        gpus=max(_gpus(r[4]) for r in rows),
        minutes=None
        if any(_minutes(r[1]) is None for r in rows)
        else max(_minutes(r[1]) or 0 for r in rows),
    )


def check_resources(options: SlurmOptions, limits: PartitionLimits) -> None:
    """Refuse resources that no node of the partition offers, or a time over its limit
    (Slurm would accept the job and leave it pending for ever)."""
    where = f"partition {limits.name}"
    if options.cpus_per_task and options.cpus_per_task > limits.cpus:
        raise HarnessError(
            f"--cpus-per-task {options.cpus_per_task} exceeds {where}: its largest node has "
            f"{limits.cpus} CPUs"
        )
    if options.mem and megabytes(options.mem) > limits.memory_mb:
        raise HarnessError(
            f"--mem {options.mem} exceeds {where}: its largest node has {limits.memory_mb} MB"
        )
    if options.gpus_per_task and options.gpus_per_task > limits.gpus:
        raise HarnessError(
            f"--gpus-per-task {options.gpus_per_task} exceeds {where}: its largest node has "
            f"{limits.gpus} GPUs"
        )
    if options.time and limits.minutes is not None and slurm_minutes(options.time) > limits.minutes:
        raise HarnessError(
            f"--time {options.time} exceeds {where}'s time limit of {limits.minutes:g} minutes"
        )


def test_submission(options: SlurmOptions) -> None:
    """``sbatch --test-only`` with the task's resources: Slurm checks the account, QOS and
    everything else it knows of, and submits nothing. A refusal quotes Slurm."""
    done = _slurm("sbatch", "--test-only", *options.sbatch_options(), "--wrap", "true")
    if done.returncode != 0:
        raise HarnessError(f"Slurm refused the sweep's jobs: {_message(done)}")


def queue_states(array_ids: list[str]) -> dict[str, str]:
    """``{task id: state}`` of the array tasks ``squeue`` still lists (``123_4``:
    ``RUNNING``, ``PENDING``...); an array that has left the queue has none."""
    if not array_ids:
        return {}
    done = _slurm(
        "squeue", "--noheader", "--array", "--jobs", ",".join(array_ids), "--format=%i|%T"
    )
    if done.returncode != 0:
        if "Invalid job id" in (done.stderr or ""):  # every array has left the queue
            return {}
        raise HarnessError(f"squeue failed: Slurm says: {_message(done)}")
    rows = [line.strip().split("|") for line in done.stdout.splitlines() if "|" in line]
    return {task: state for task, state in rows}


def cancel_jobs(array_ids: list[str]) -> None:
    """``scancel`` the arrays (pending tasks never start; running ones get SIGTERM, then
    SIGKILL after Slurm's KillWait)."""
    if not array_ids:
        return
    done = _slurm("scancel", *array_ids)
    if done.returncode != 0:
        raise HarnessError(f"scancel failed: Slurm says: {_message(done)}")
