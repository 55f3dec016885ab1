"""The resources a grid's cells ask of a Slurm cluster: the ``[executor.slurm]`` table of a
grid file, the same keys as ``sweep --executor slurm``'s options (which take precedence).

The values are Slurm's own forms, checked when the grid is read so that a typing mistake
is one line before anything is submitted: ``time`` is ``minutes``, ``minutes:seconds``,
``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes`` or
``days-hours:minutes:seconds``; ``mem`` is a whole number with an optional unit
(``K``, ``M``, ``G``, ``T``; megabytes without one). None of these keys enters a cell's
key or a fingerprint: where a cell ran does not change what it computes.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, Field

from harness.base.errors import HarnessError
from harness.config.schema import SPEC_CONFIG, Int, Str

__all__ = [
    "SlurmTable",
    "ExecutorTable",
    "SLURM_KEYS",
    "TIME_PATTERN",
    "MEM_PATTERN",
    "slurm_minutes",
    "megabytes",
    "check_time",
    "check_mem",
]

TIME_PATTERN = r"^([0-9]+-[0-9]+(:[0-9]+){0,2}|[0-9]+(:[0-9]+){0,2})$"
MEM_PATTERN = r"^[1-9][0-9]*([KMGT]B?)?$"

_Time = Annotated[
    Str,
    Field(pattern=TIME_PATTERN, examples=["90", "4:00:00", "2-00:00:00"]),
]
_Mem = Annotated[Str, Field(pattern=MEM_PATTERN, examples=["16G", "64000M"])]


class SlurmTable(BaseModel):
    """``[executor.slurm]``: what each array task of ``sweep --executor slurm`` asks for."""

    model_config = SPEC_CONFIG
    partition: Str | None = None
    #: GPUs of one task; more than 1 trains each cell on that many processes (DDP).
    gpus_per_task: Annotated[Int, Field(ge=0)] | None = None
    cpus_per_task: Annotated[Int, Field(ge=1)] | None = None
    mem: _Mem | None = None
    time: _Time | None = None
    #: How many array tasks run at once (Slurm's ``--array=...%N``).
    array_parallelism: Annotated[Int, Field(ge=1)] | None = None
    account: Str | None = None
    qos: Str | None = None


class ExecutorTable(BaseModel):
    """``[executor]``: where a sweep's cells run, one table per executor."""

    model_config = SPEC_CONFIG
    slurm: SlurmTable = SlurmTable()


#: The keys of ``[executor.slurm]``, each also a ``sweep`` option (``--gpus-per-task``).
SLURM_KEYS = tuple(SlurmTable.model_fields)


def slurm_minutes(text: str) -> float:
    """A Slurm time limit (one of :data:`TIME_PATTERN`'s forms) in minutes."""
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return int(days) * 1440 + hours * 60 + minutes + seconds / 60
    if len(parts) == 3:
        return parts[0] * 60 + parts[1] + parts[2] / 60
    return parts[0] + (parts[1] / 60 if len(parts) == 2 else 0)


_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def megabytes(text: str) -> float:
    """A Slurm memory size (:data:`MEM_PATTERN`) in megabytes."""
    match = re.fullmatch(r"([0-9]+)([KMGT]?)B?", text)
    if match is None:
        raise HarnessError(f"not a memory size: {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2) or "M"]


def check_time(text: str, where: str) -> str:
    """``text`` when it is a Slurm time limit, else the one error line starting with ``where``
    (the option or grid key, and the value as written)."""
    if not re.fullmatch(TIME_PATTERN, text) or slurm_minutes(text) <= 0:
        raise HarnessError(
            f"{where}: expected a Slurm time limit like 90 (minutes), 4:00:00 or "
            f"2-00:00:00, longer than 0"
        )
    return text


def check_mem(text: str, where: str) -> str:
    """``text`` when it is a Slurm memory size, else the one error line starting with ``where``."""
    if not re.fullmatch(MEM_PATTERN, text):
        raise HarnessError(f"{where}: expected a memory size like 16G or 64000M (K, M, G or T)")
    return text
