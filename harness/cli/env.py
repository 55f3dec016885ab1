"""``python -m harness env RUN_ID``: the environment a run recorded, as pip constraints.

Its arguments and its function are here. The module imports nothing heavy, so that
``--help`` answers at once; the command's work, and what it loads, is
:mod:`harness.cli.env_command`, imported when it runs."""

from __future__ import annotations

import argparse

from harness.cli.outputs import add_force_argument, add_output_argument

__all__ = ["add_env_parser", "cmd_env"]


def cmd_env(args: argparse.Namespace) -> int:
    """Print or write the constraints of a run's environment
    (:func:`harness.cli.env_command.cmd_env`)."""
    # deferred: MLflow and torch load only when the command runs
    from harness.cli import env_command

    return env_command.cmd_env(args)


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
