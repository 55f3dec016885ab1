"""``env``'s arguments: the run, and where its constraints are written."""

from __future__ import annotations

import argparse

from harness.cli.env import cmd_env
from harness.cli.outputs import add_force_argument, add_output_argument

__all__ = ["add_env_parser"]


def add_env_parser(subparsers) -> argparse.ArgumentParser:
    env = subparsers.add_parser(
        "env",
        help="print a run's recorded environment as pip constraints, with its commit",
        description="The package versions and the commit a run recorded, as a pip constraints "
        "file: at that commit, pip install -c FILE -e . rebuilds the environment.",
    )
    env.add_argument("run_id", metavar="RUN_ID", help="a run in the tracking store")
    add_output_argument(
        env,
        "--out",
        metavar="FILE",
        help="write the constraints to FILE (atomically) instead of printing them",
    )
    add_force_argument(env)
    env.set_defaults(func=cmd_env)
    return env
