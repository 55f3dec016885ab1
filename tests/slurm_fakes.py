"""Stand-ins for Slurm's client commands, for the refusals that need a cluster to answer
(a partition it does not know, resources beyond its nodes, an account it refuses) without
one: shell scripts that print what Slurm 22.05 prints (transcribed from a real
single-node cluster, ``tests/engine/test_slurm.py``) for two partitions:

* ``debug`` (the default): nodes of 2 CPUs and 1000 MB, no GPU, a time limit of 1 hour;
* ``gpu``: nodes of 8 CPUs, 64000 MB and 2 GPUs, no time limit.

``sbatch --test-only`` refuses the account ``nobody`` as Slurm does; any real submission
fails, so a refusal test that reached it would say so.
"""

from __future__ import annotations

from pathlib import Path

SCRIPTS = {
    "sinfo": r"""
case "$*" in
  *"-p debug"*) echo 'debug*|1:00:00|2|1000|(null)' ;;
  *"-p gpu"*) echo 'gpu|infinite|8|64000|gpu:2(S:0-1)' ;;
  *"-p "*) ;;
  *) echo 'debug*|1:00:00|2|1000|(null)'; echo 'gpu|infinite|8|64000|gpu:2(S:0-1)' ;;
esac
""",
    "scontrol": r"""
case "$3" in
  debug|gpu) echo "PartitionName=$3 State=UP" ;;
  *) echo "Partition $3 not found"; exit 1 ;;
esac
""",
    "sbatch": r"""
case "$*" in
  *--test-only*--account=nobody*)
    echo 'sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified' >&2
    exit 1 ;;
  *--test-only*)
    echo 'sbatch: Job 7 to start at 2026-01-01T00:00:00 using 1 processors on nodes vm in partition debug' >&2
    ;;
  *) echo 'sbatch: error: this stand-in submits nothing' >&2; exit 1 ;;
esac
""",
    "squeue": "exit 0\n",
    "scancel": "exit 0\n",
    "srun": "exit 0\n",
}


def install(folder: Path) -> Path:
    """The stand-ins as executables under ``folder/bin``; returns that folder."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in SCRIPTS.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body.lstrip("\n"))
        path.chmod(0o755)
    return bin_dir
