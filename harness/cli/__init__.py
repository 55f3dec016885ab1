"""``python -m harness``: argument parsing for every subcommand, one ``error:`` line per
user mistake. :func:`run_main` is the entry point of ``python -m harness`` and of the
``dml-harness`` console script.

The package re-exports the names of its light modules: the entry points, the argument
types, the output checks, the process helpers and each subcommand's parser and function
(``harness/cli/<command>.py``). A command's work (``harness/cli/<command>_command.py``,
and ``store``, ``estimates``, ``sweep_cluster``, ``sweep_tuned`` beside them) loads torch,
the engine or MLflow, so it is imported by its command's function when that command
runs, not here."""

from harness.cli.arguments import (
    DATASET_HELP,
    EMBEDDED_DEFAULT,
    EXPERIMENT_NAME_MAX,
    SEED_LIMIT,
    TABLE_NAME_MAX,
    at_least,
    dataset_label,
    default_file_name,
    experiment_name,
    file_name,
    int_list,
    model_name,
    name_list,
    positive_number,
)
from harness.cli.deviations import add_deviations_parser, cmd_deviations
from harness.cli.env import add_env_parser, cmd_env
from harness.cli.evaluate import add_evaluate_parser, cmd_evaluate
from harness.cli.explain import add_explain_parser, cmd_explain
from harness.cli.explain_table import add_explain_table_parser, cmd_explain_table
from harness.cli.export import add_export_parser, cmd_export
from harness.cli.fetch import cmd_fetch, cmd_verify
from harness.cli.listings import (
    add_fetch_parser,
    add_listing_parsers,
    add_verify_parser,
    cmd_datasets,
    cmd_methods,
)
from harness.cli.main import DEBUG_HELP, PROG, Parser, build_parser, main, run_main
from harness.cli.outputs import (
    add_force_argument,
    add_output_argument,
    harness_record,
    option_flags,
    output_file,
    output_flags,
    output_folder,
    output_stem,
    subcommands,
)
from harness.cli.processes import serve_process_group, stop_tree, terminated
from harness.cli.rerun import add_rerun_parser, cmd_rerun
from harness.cli.run import add_run_parser, cmd_run
from harness.cli.schema import add_schema_parser, cmd_schema
from harness.cli.sweep import add_cluster_arguments, add_sweep_parser, cmd_sweep
from harness.cli.table import add_table_parser, cmd_table
from harness.cli.tune import add_tune_parser, cmd_tune
from harness.cli.ui import cmd_ui

__all__ = [
    "DATASET_HELP",
    "EMBEDDED_DEFAULT",
    "EXPERIMENT_NAME_MAX",
    "SEED_LIMIT",
    "TABLE_NAME_MAX",
    "at_least",
    "dataset_label",
    "default_file_name",
    "experiment_name",
    "file_name",
    "int_list",
    "model_name",
    "name_list",
    "positive_number",
    "cmd_deviations",
    "cmd_env",
    "cmd_evaluate",
    "cmd_explain",
    "cmd_explain_table",
    "cmd_export",
    "cmd_fetch",
    "cmd_verify",
    "cmd_datasets",
    "cmd_methods",
    "DEBUG_HELP",
    "PROG",
    "Parser",
    "build_parser",
    "main",
    "run_main",
    "add_force_argument",
    "add_output_argument",
    "harness_record",
    "option_flags",
    "output_file",
    "output_flags",
    "output_folder",
    "output_stem",
    "subcommands",
    "serve_process_group",
    "stop_tree",
    "terminated",
    "cmd_rerun",
    "cmd_run",
    "cmd_schema",
    "cmd_sweep",
    "cmd_table",
    "cmd_tune",
    "cmd_ui",
    "add_deviations_parser",
    "add_env_parser",
    "add_evaluate_parser",
    "add_explain_parser",
    "add_explain_table_parser",
    "add_export_parser",
    "add_rerun_parser",
    "add_run_parser",
    "add_schema_parser",
    "add_sweep_parser",
    "add_cluster_arguments",
    "add_table_parser",
    "add_tune_parser",
    "add_listing_parsers",
    "add_fetch_parser",
    "add_verify_parser",
]
