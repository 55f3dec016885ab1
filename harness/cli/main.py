"""``python -m harness``: run, evaluate, sweep, tune, table, explain,
explain-table, datasets, methods, ui, deviations, rerun, export, schema, env.

Every user error is one line on stderr and exit status 2 (argparse's usage errors
too); nothing is written until a command has its result (``--json`` files are written
atomically). An unexpected exception is a bug, not a user error: one
``error: internal error: ...`` line and exit status 1, or its traceback with ``--debug``.

Both entry points, ``python -m harness`` and the ``dml-harness`` console script, call
:func:`run_main`, which installs the SIGTERM handler before running :func:`main`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
from pathlib import Path
from typing import Any

from harness.base.errors import HarnessError
from harness.cli.deviations import add_deviations_parser
from harness.cli.env import add_env_parser
from harness.cli.evaluate import add_evaluate_parser
from harness.cli.explain import add_explain_parser
from harness.cli.explain_table import add_explain_table_parser
from harness.cli.export import add_export_parser
from harness.cli.faults import FAULT_ENV, fault_train
from harness.cli.listings import add_listing_parsers
from harness.cli.processes import terminated
from harness.cli.rerun import add_rerun_parser
from harness.cli.run import add_run_parser
from harness.cli.schema import add_schema_parser
from harness.cli.sweep import add_sweep_parser
from harness.cli.table import add_table_parser
from harness.cli.tune import add_tune_parser
from harness.store.invocation import record_invocation

__all__ = ["PROG", "DEBUG_HELP", "Parser", "build_parser", "run_main", "main"]

PROG = "python -m harness"


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors as the harness's own: one ``error:`` line (naming the
    subcommand) and exit status 2, instead of a usage block. Subcommands inherit it."""

    def error(self, message: str):
        command = self.prog.removeprefix(PROG).strip()
        where = f"{command}: " if command else ""
        raise HarnessError(f"{where}{message} (see {self.prog} --help)")


DEBUG_HELP = "on an internal error, print its traceback (a bug: please report it with it)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    add_run_parser(sub)
    add_evaluate_parser(sub)
    add_sweep_parser(sub)
    add_tune_parser(sub)
    add_table_parser(sub)
    add_explain_parser(sub)
    add_explain_table_parser(sub)
    add_listing_parsers(sub)
    add_deviations_parser(sub)
    add_rerun_parser(sub)
    add_export_parser(sub)
    add_schema_parser(sub)
    add_env_parser(sub)
    # also after the subcommand; SUPPRESS keeps one given before
    for command in sub.choices.values():
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP
        )
    return parser


def _one_line(err: BaseException) -> str:
    text = str(err)
    # Errors raised in DataLoader workers arrive wrapped with the worker's traceback.
    marker = "HarnessError: "
    if marker in text:
        text = text.rsplit(marker, 1)[-1]
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


def _discard_stdout() -> None:
    """Send what is left of stdout to /dev/null, so that the exit-time flush of output that
    could not be written adds no second message."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.stdout = open(os.devnull, "w")  # open until the process exits


def _is_store_error(err: BaseException) -> bool:
    """An error raised by the tracking or Optuna store (MLflow, SQLAlchemy, a database driver)."""
    return type(err).__module__.split(".")[0] in (
        "mlflow",
        "sqlalchemy",
        "sqlite3",
        "psycopg2",
        "psycopg",
        "optuna",
    )


def run_main(argv: list[str] | None = None) -> int:
    """The program entry point (``python -m harness`` and the ``dml-harness`` script):
    :func:`main` with SIGTERM turned into ``KeyboardInterrupt``. Kept out of :func:`main`
    so that calling ``main`` from Python (tests, notebooks) leaves signals alone."""
    signal.signal(signal.SIGTERM, terminated)
    # The fault-injection suite's one seam (test-only): a part of each run or the atomic writer.
    fault = os.environ.get(FAULT_ENV, "")
    return main(argv, train=fault_train(fault) if fault else None)


def _program() -> str:
    """How this process was started: the console script, else ``python -m harness``."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "dml-harness" if name == "dml-harness" else "python -m harness"


def main(argv: list[str] | None = None, *, train: Any = None) -> int:
    """Run the command of ``argv`` (default: the process's arguments); its errors are one
    line on stderr. ``train``: what trains one run of ``run``, ``sweep`` and ``tune``
    (default :func:`harness.engine.run.training.train_run`; tests and notebooks hand a
    stand-in)."""
    args = None
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        record_invocation(_program(), argv)  # each run records the command that made it
        code = args.func(args) if train is None else args.func(args, train=train)
        sys.stdout.flush()  # a full disk or a closed pipe is reported here, not at exit
        return code
    except HarnessError as err:  # the user's input: one line, with or without --debug
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped (head, less): not an error
        sys.stdout = open(os.devnull, "w")  # keeps Python's exit-time flush quiet
        return 0
    except Exception as err:  # errors from DataLoader workers are re-raised as other types
        if (
            isinstance(err, OSError) and err.errno == errno.ENOSPC
        ):  # stdout on a full disk (or /dev/full)
            _discard_stdout()
            print(
                "error: disk full: the output could not be written (No space left on device)",
                file=sys.stderr,
            )
            return 2
        if "HarnessError" in str(err):
            print(f"error: {_one_line(err)}", file=sys.stderr)
            return 2
        if _is_store_error(err):  # e.g. a store locked by another writer past MLflow's timeout
            print(
                f"error: the tracking store failed ({type(err).__name__}: {_one_line(err)[:300]}); "
                f"run the command again once it answers (run --resume continues from the last checkpoint)",
                file=sys.stderr,
            )
            return 2
        if getattr(args, "debug", False):
            raise
        print(
            f"error: internal error: {type(err).__name__}: {_one_line(err)[:300]} "
            f"(run again with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
