"""``python -m harness``: argument parsing for every subcommand, one ``error:`` line per
user mistake. :func:`run_main` is the entry point of ``python -m harness`` and of the
``dml-harness`` console script."""

from harness.cli.main import run_main

__all__ = ["run_main"]
