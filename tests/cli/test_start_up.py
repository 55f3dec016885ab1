"""The command line answers at once: ``python -m harness --help`` and every subcommand's
``--help`` load neither torch nor a method plugin, each checked in a fresh interpreter;
``methods`` lists every registered plugin, the built-in ones from their catalog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from harness.base.registry import METHOD_PLUGIN_GROUP, source_digest
from harness.cli.main import build_parser, main
from harness.cli.outputs import subcommands
from harness.config.method_catalog import METHOD_LINES, SOURCE_DIGEST
from harness.methods import METHODS
from harness.methods.listing import PLUGINS, method_lines

REPO = Path(__file__).resolve().parents[2]

#: Run ``python -m harness ARGV`` as the console does, then print the modules it loaded.
PROBE = """
import json, runpy, sys
sys.argv = ["harness", *json.loads(sys.argv[1])]
try:
    runpy.run_module("harness", run_name="__main__")
except SystemExit as exit:
    code = exit.code
print("\\n" + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _help_argvs() -> list[list[str]]:
    """``--help`` of the program, of every subcommand and of ``datasets``'s subcommands."""
    argvs = [["--help"]]
    for name, parser in subcommands(build_parser()).items():
        argvs.append([name, "--help"])
        argvs += [[name, sub, "--help"] for sub in subcommands(parser)]
    return argvs


def _loaded(argv: list[str], **env_vars: str) -> tuple[int, list[str], str]:
    env = {**os.environ, **env_vars, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.rstrip().splitlines()[-1])
    return record["code"], record["modules"], done.stdout


def _heavy(modules: list[str]) -> list[str]:
    """torch and the plugins' modules among ``modules`` (importing any module of
    ``harness.methods`` imports every plugin)."""
    return [m for m in modules if m.split(".")[0] == "torch" or m.startswith("harness.methods")]


def test_the_help_argvs_cover_every_subcommand():
    argvs = _help_argvs()
    commands = {argv[0] for argv in argvs if len(argv) > 1}
    assert {"run", "sweep", "tune", "methods", "deviations", "schema"} <= commands
    assert ["datasets", "fetch", "--help"] in argvs


@pytest.mark.parametrize("argv", _help_argvs(), ids=" ".join)
def test_help_loads_neither_torch_nor_a_plugin(argv):
    code, modules, out = _loaded(argv)
    assert code == 0
    assert "usage:" in out
    assert _heavy(modules) == []


def test_the_check_finds_torch_and_the_plugins():
    """The probe can fail: ``schema`` loads the plugins (their options), and torch with them."""
    code, modules, _ = _loaded(["schema", "protocol"])
    assert code == 0
    heavy = _heavy(modules)
    assert "torch" in heavy and "harness.methods.plain" in heavy


def test_methods_lists_the_registry_without_loading_a_plugin(tmp_path):
    """In a fresh interpreter ``methods`` reads the catalog of built-in plugins and loads
    neither torch nor a plugin; what it prints is what the registry gives (so the catalog
    is not stale: ``nox -s docs`` writes it). Where a package installs plugins of its own
    (``pip install ./my-plugin``), their lines come from their classes the first time (the
    registry loads) and from the lines kept then afterwards (nothing heavy loads)."""
    assert METHOD_LINES == method_lines(built_in=True) and SOURCE_DIGEST == source_digest(PLUGINS)
    first = _loaded(["methods"], DML_HARNESS_CACHE=str(tmp_path))
    again = _loaded(["methods"], DML_HARNESS_CACHE=str(tmp_path))
    if entry_points(group=METHOD_PLUGIN_GROUP):
        lines = method_lines()
        assert "harness.methods.plain" in _heavy(first[1])
    else:
        lines = METHOD_LINES
        assert _heavy(first[1]) == []
    listing = "\n".join(lines[n] for n in sorted(lines))
    for code, _, out in (first, again):
        assert code == 0 and out.rstrip().rsplit("\n", 1)[0].rstrip() == listing
    assert _heavy(again[1]) == []


def test_deviations_help_lists_the_grids_from_their_files(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["deviations", "--help"])
    grids = sorted(p.stem for p in (REPO / "protocols" / "grids").glob("*.toml"))
    # argparse wraps the help, at spaces and hyphens
    assert grids and ",".join(grids) in "".join(capsys.readouterr().out.split())


def test_methods_lists_every_registered_plugin(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out.splitlines()
    named = [line.split()[0] for line in out if line and not line.startswith(" ")]
    assert named == METHODS.list()
    assert all("; options: " in line for line in out if line.startswith(" "))
