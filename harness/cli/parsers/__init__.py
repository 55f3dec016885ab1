"""The parser of each subcommand, one module per command. A parser imports its command's
function (``harness.cli.run.cmd_run``), whose module is light: the command's work, with
torch and the engine, is imported when the command runs, so ``--help`` and a usage error
load neither."""

from harness.cli.parsers.deviations import add_deviations_parser
from harness.cli.parsers.env import add_env_parser
from harness.cli.parsers.evaluate import add_evaluate_parser
from harness.cli.parsers.explain import add_explain_parser
from harness.cli.parsers.explain_table import add_explain_table_parser
from harness.cli.parsers.export import add_export_parser
from harness.cli.parsers.listings import add_fetch_parser, add_listing_parsers, add_verify_parser
from harness.cli.parsers.rerun import DEFAULT_TOLERANCE, DESCRIPTION, add_rerun_parser
from harness.cli.parsers.run import add_run_parser
from harness.cli.parsers.schema import KINDS, add_schema_parser
from harness.cli.parsers.sweep import add_cluster_arguments, add_sweep_parser
from harness.cli.parsers.table import add_table_parser
from harness.cli.parsers.tune import add_tune_parser

__all__ = [
    "add_deviations_parser",
    "add_env_parser",
    "add_evaluate_parser",
    "add_explain_parser",
    "add_explain_table_parser",
    "add_export_parser",
    "add_listing_parsers",
    "add_fetch_parser",
    "add_verify_parser",
    "add_rerun_parser",
    "DEFAULT_TOLERANCE",
    "DESCRIPTION",
    "add_run_parser",
    "add_schema_parser",
    "KINDS",
    "add_sweep_parser",
    "add_cluster_arguments",
    "add_table_parser",
    "add_tune_parser",
]
