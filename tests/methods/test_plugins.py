"""Plugins beyond the five papers: one registered for a test passes the registry-wide
checks of the suite (schema, grids' ``methods = "all"``, explanation, conformance), and
the entry-point group ``dml_harness.methods`` loads the plugins of installed packages,
once, at the registry's first lookup, with one error line for a broken one."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch.nn.functional as F
from torch import nn

from harness.base.errors import HarnessError
from harness.base.registry import Registry
from harness.cli.main import main
from harness.config.grids import load_grid
from harness.methods import (
    METHODS,
    HeadOutput,
    Method,
    PairExplainer,
    Tunable,
    list_methods,
    register_method,
)
from harness.methods.base import PLUGIN_GROUP

REPO = Path(__file__).resolve().parents[2]
TINY_PROTOCOL = REPO / "tests" / "protocols" / "tiny.toml"

# ------------------------------------------------------------------ a plugin added for a test

THROWAWAY = "throwaway_pool"


class ThrowawayHead(Method, Tunable):
    """Average pooling + linear, scaled before normalising (a plugin that declares only
    ``embed``, one option and a search space)."""

    def __init__(self, *, channels, embedding_size, scale: float = 2.0):
        super().__init__(channels=channels, embedding_size=embedding_size)
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale = scale
        self.project = nn.Linear(self.in_channels, embedding_size)

    def embed(self, maps):
        return HeadOutput(
            embedding=F.normalize(self.scale * self.project(maps[-1].mean(dim=(2, 3))), dim=-1)
        )

    @classmethod
    def search_space(cls, trial, *, embedding_size):
        return {"scale": trial.suggest_float("scale", 0.5, 4.0)}


@pytest.fixture
def throwaway():
    """``THROWAWAY`` registered as a plugin file in methods/ would be, for one test."""
    register_method(THROWAWAY, description="test plugin: average pooling + linear")(ThrowawayHead)
    yield THROWAWAY
    METHODS.remove(THROWAWAY)


def test_a_new_plugin_is_listed_with_its_options(throwaway, capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert f"{throwaway} " in out and "options: scale=2.0" in out
    assert throwaway in list_methods(ablations=False)


def test_a_new_plugin_has_its_options_in_the_schema_and_leaves_the_published_copy_valid(throwaway):
    from harness.cli.schema_command import schema_text
    from tests.config.test_schema import (
        test_every_plugin_declares_option_types_its_defaults_satisfy,
        test_the_published_copy_is_the_generated_schema_up_to_registered_methods,
    )

    options = json.loads(schema_text("protocol"))["properties"]["methods"]["properties"][throwaway]
    assert (
        options["properties"]["scale"]["type"] == "number"
        and options["additionalProperties"] is False
    )
    test_the_published_copy_is_the_generated_schema_up_to_registered_methods("protocol")
    test_every_plugin_declares_option_types_its_defaults_satisfy(throwaway)


@pytest.mark.parametrize("smoke", [False, True])
def test_a_grid_of_all_methods_gets_rows_for_a_new_plugin(throwaway, smoke):
    grid = load_grid("fair-roth2020", smoke=smoke)
    methods = {cell.method for cell in grid.cells}
    assert throwaway in methods and methods == set(list_methods(ablations=False))
    assert grid.axes["methods"] == [m for m in list_methods(ablations=False) if m != "diml_train"]


def test_a_new_plugin_without_pair_maps_declines_them(throwaway):
    from tests.engine.test_explain import (
        test_every_method_gives_pair_maps_or_declines_and_the_baseline_maps_every_one,
    )

    assert not isinstance(ThrowawayHead(channels={"s32": 8}, embedding_size=4), PairExplainer)
    test_every_method_gives_pair_maps_or_declines_and_the_baseline_maps_every_one(throwaway)


def test_a_new_plugin_passes_the_conformance_suite(throwaway):
    from tests.methods import test_conformance as suite
    from tests.methods import test_roles as roles

    suite.test_builds_with_metadata(throwaway)
    for loss in ("margin", "proxy_anchor"):
        suite.test_forward_loss_backward_and_optimizer_groups(throwaway, loss)
    suite.test_state_dict_round_trip_gives_the_same_embedding(throwaway)
    assert throwaway in roles.having(Tunable)
    roles.test_tunable(throwaway)
    suite.test_every_method_declares_a_row_label_of_its_own()


# ------------------------------------------------------------------ grids: "all" and exclude


def _grid(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "g.toml"
    path.write_text(
        textwrap.dedent("""\
        protocol = "smoke"
        losses = ["margin"]
        backbones = ["efficientnet_lite0"]
        datasets = ["synthetic"]
        seeds = [0]
        """)
        + body
    )
    return path


def test_all_methods_less_the_excluded_ones_is_the_methods_all_list(tmp_path):
    grid = load_grid(_grid(tmp_path, 'methods = "all"\nexclude = ["sam", "avsl"]\n'))
    assert grid.axes["methods"] == [
        m for m in list_methods(ablations=False) if m not in ("sam", "avsl")
    ]


@pytest.mark.parametrize(
    "body, message",
    [
        (
            'methods = "all"\nexclude = ["samm"]\n',
            "exclude names 'samm', which is not a registered method",
        ),
        ('methods = ["plain"]\nexclude = ["sam"]\n', "'exclude' applies to methods = \"all\""),
        (
            'methods = "every"\n',
            'grid key \'methods\' = "every": expected a non-empty list of strings or "all"$',
        ),
    ],
)
def test_a_bad_methods_axis_is_refused_with_its_reason(tmp_path, body, message):
    with pytest.raises(HarnessError, match=message):
        load_grid(_grid(tmp_path, body))


def test_all_methods_excluding_every_one_is_refused(tmp_path):
    exclude = ", ".join(f'"{m}"' for m in list_methods(ablations=False))
    with pytest.raises(HarnessError, match="leaves no method"):
        load_grid(_grid(tmp_path, f'methods = "all"\nexclude = [{exclude}]\n'))


# ------------------------------------------------------------------ entry points


def _distribution(
    folder: Path,
    name: str,
    entry_points: dict[str, str],
    modules: dict[str, str],
    group: str = PLUGIN_GROUP,
) -> None:
    """An installed distribution as an installer leaves it: its modules and a ``.dist-info``
    with ``METADATA`` and ``entry_points.txt``."""
    info = folder / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    for module, code in modules.items():
        (folder / f"{module}.py").write_text(textwrap.dedent(code))


GROUP = "dml_harness_tests.things"


@pytest.fixture
def things(tmp_path, monkeypatch):
    """A registry of the test's own group, importable by plugins as ``things_home.THINGS``;
    plugin modules are imported from ``tmp_path`` and forgotten afterwards."""
    home = types.ModuleType("things_home")
    home.THINGS = Registry("thing", entry_point_group=GROUP)
    home.THINGS.register("builtin")("in the package itself")
    monkeypatch.setitem(sys.modules, "things_home", home)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield home.THINGS
    for module in set(sys.modules) - before:
        del sys.modules[module]


def test_installed_plugins_are_imported_once_at_the_first_lookup(things, tmp_path):
    _distribution(
        tmp_path,
        "thing-plugins",
        {"red": "red_thing", "blue": "blue_thing"},
        {
            "red_thing": "from things_home import THINGS\nTHINGS.register('red')('r')\n",
            "blue_thing": "from things_home import THINGS\nTHINGS.register('blue')('b')\n",
        },
        group=GROUP,
    )
    assert "red_thing" not in sys.modules  # not at construction
    assert things.list() == ["blue", "builtin", "red"] and things.get("red") == "r"
    assert "blue" in things and len(things) == 3
    del sys.modules["red_thing"]
    assert things.get("red") == "r" and "red_thing" not in sys.modules  # not imported again


@pytest.mark.parametrize(
    "module, expected",
    [
        (
            "raise ImportError('no module named torchvision_extras')",
            "failed to load: ImportError: no module named torchvision_extras",
        ),
        (
            "from things_home import THINGS\nTHINGS.register('builtin')('again')\n",
            "thing 'builtin' is already registered; rename the plugin's thing",
        ),
        ("x = 1\n", "registered no thing when imported"),
    ],
)
def test_a_broken_plugin_is_one_error_naming_its_distribution_and_entry_point(
    things, tmp_path, module, expected
):
    _distribution(
        tmp_path, "broken-things", {"bad": "bad_thing"}, {"bad_thing": module}, group=GROUP
    )
    label = f"thing plugin 'bad' (entry point bad = \"bad_thing\" of distribution broken-things 0.1, group {GROUP})"
    for _ in range(2):  # every lookup refuses, not only the first
        with pytest.raises(HarnessError) as err:
            things.get("builtin")
        assert str(err.value).startswith(label) and expected in str(err.value)


def _harness(
    *args: str, cwd: Path, path: list[Path], timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(
            [*map(str, path), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
    }
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_broken_installed_plugin_is_one_error_line_of_the_command(tmp_path):
    site = tmp_path / "site"
    _distribution(
        site,
        "broken-head",
        {"brokenhead": "broken_head"},
        {"broken_head": "import no_such_module_anywhere\n"},
    )
    done = _harness("methods", cwd=tmp_path, path=[site])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert line == (
        "error: method plugin 'brokenhead' (entry point brokenhead = \"broken_head\" of distribution "
        f"broken-head 0.1, group {PLUGIN_GROUP}) failed to load: ModuleNotFoundError: "
        "No module named 'no_such_module_anywhere'"
    )


_VARIANT = (
    "from harness.methods import register_variant\nfrom harness.methods.plain import PlainHead\n"
)

#: Installed plugins the command refuses, each with one error line, exit status 2, nothing
#: written and no run: (the plugin module's code, the command, what the line says).
PLUGIN_REFUSALS = [
    (
        _VARIANT + "register_variant('all', PlainHead)\n",
        ("methods",),
        "method plugin 'bad' (entry point bad = \"bad_head\" of distribution bad-head 0.1, "
        f"group {PLUGIN_GROUP}): method name 'all' is reserved: --methods all and a grid's "
        'methods = "all" stand for every method; rename the plugin\'s method',
    ),
    pytest.param(  # a command's start, 8 s: the reserved name's case runs by default
        _VARIANT + "register_variant('a,b', PlainHead)\n",
        ("run", "--methods", "a,b", "--protocol", str(TINY_PROTOCOL)),
        "method name 'a,b' is not a method name: expected letters, digits",
        marks=pytest.mark.slow,
    ),
    (
        _VARIANT + "register_variant('all', PlainHead)\n",
        ("run", "--methods", "all", "--protocol", str(TINY_PROTOCOL)),
        "method name 'all' is reserved",
    ),
    (
        "import sys\nsys.exit(0)\n",
        ("run", "--methods", "plain", "--protocol", str(TINY_PROTOCOL)),
        "method plugin 'bad' (entry point bad = \"bad_head\" of distribution bad-head 0.1, "
        f"group {PLUGIN_GROUP}) called sys.exit(0) when imported; a plugin's import only "
        "registers its methods",
    ),
]


@pytest.mark.parametrize(
    "module, argv, expected",
    PLUGIN_REFUSALS,
    ids=[" ".join(getattr(c, "values", c)[1][:3]) for c in PLUGIN_REFUSALS],
)
def test_an_installed_plugin_that_cannot_work_is_refused(tmp_path, module, argv, expected):
    """The refusal contract, for a command started as users start it (the plugin is
    installed, found through its entry point): exit 2, one ``error:`` line, no traceback,
    nothing written (no store, no dataset, no run)."""
    site, work = tmp_path / "site", tmp_path / "work"
    _distribution(site, "bad-head", {"bad": "bad_head"}, {"bad_head": module})
    work.mkdir()
    env = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}",
        "DML_HARNESS_DATA": str(work / "data"),
    }
    done = _harness(*argv, cwd=work, path=[site], env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert expected in lines[0]
    assert list(work.iterdir()) == []


# ------------------------------------------------------------------ a package installed with pip

PACKAGE_PLUGIN = '''\
"""``tinyhead``: a method plugin of its own distribution: average pooling + linear."""

import torch.nn.functional as F
from torch import nn

from harness.methods.base import HeadOutput, Method, register_method


@register_method("tinyhead", description="installed plugin: average pooling + linear")
class TinyHead(Method):
    def __init__(self, *, channels, embedding_size, bias: bool = True):
        super().__init__(channels=channels, embedding_size=embedding_size)
        self.project = nn.Linear(self.in_channels, embedding_size, bias=bias)

    def embed(self, maps):
        return HeadOutput(embedding=F.normalize(self.project(maps[-1].mean(dim=(2, 3))), dim=-1))
'''

PACKAGE_PYPROJECT = f'''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "tinyhead-plugin"
version = "0.1.0"

[tool.setuptools]
py-modules = ["tinyhead_plugin"]

[project.entry-points."{PLUGIN_GROUP}"]
tinyhead = "tinyhead_plugin"
'''


def _repository_state() -> str:
    git = shutil.which("git")
    if git is None:
        return "no git"
    return subprocess.run(
        [git, "status", "--porcelain", "--untracked-files=all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    """The ``tinyhead-plugin`` package built and installed by pip into a folder of its own
    (``--target``), which the harness's processes get on their ``PYTHONPATH``."""
    root = tmp_path_factory.mktemp("plugin-package")
    (root / "src").mkdir()
    (root / "src" / "pyproject.toml").write_text(PACKAGE_PYPROJECT)
    (root / "src" / "tinyhead_plugin.py").write_text(PACKAGE_PLUGIN)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--target",
            str(root / "site"),
            str(root / "src"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 and "No module named pip" in done.stderr:
        pytest.skip("pip is not installed in the test environment")
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((root / "site").glob("tinyhead_plugin-0.1.0.dist-info/entry_points.txt"))
    return root / "site"


def test_an_installed_package_s_plugin_is_listed(installed_plugin, tmp_path):
    state = _repository_state()
    done = _harness("methods", cwd=tmp_path, path=[installed_plugin])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tinyhead       installed plugin: average pooling + linear" in done.stdout
    assert "options: bias=True" in done.stdout and "plain " in done.stdout
    assert _repository_state() == state


def test_an_installed_package_s_plugin_is_listed_from_kept_lines_until_its_file_changes(
    installed_plugin, tmp_path
):
    site = tmp_path / "site"
    shutil.copytree(installed_plugin, site)
    env = {"DML_HARNESS_CACHE": str(tmp_path / "cache")}

    def listing() -> tuple[str, bool]:
        path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "harness", "methods"],
            cwd=tmp_path,
            env={**os.environ, **env, "PYTHONPATH": path},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        torch = any(line.split("|")[-1].strip() == "torch" for line in done.stderr.splitlines())
        return done.stdout, torch

    first, first_torch = listing()
    kept, kept_torch = listing()
    assert "installed plugin: average pooling + linear" in first and kept == first
    assert first_torch and not kept_torch  # the kept lines: neither the plugin nor torch
    module = site / "tinyhead_plugin.py"
    module.write_text(module.read_text().replace("average pooling", "mean pooling"))
    edited, edited_torch = listing()
    assert "installed plugin: mean pooling + linear" in edited and edited_torch
    env["DML_HARNESS_CACHE"] = str(module)  # a file, not a folder: nothing can be kept
    unkept, unkept_torch = listing()
    assert unkept == edited and unkept_torch


@pytest.mark.slow
def test_an_installed_package_s_plugin_trains_and_evaluates(
    installed_plugin, tmp_path, data_root, tracking_dir
):
    state = _repository_state()
    done = _harness(
        "run",
        "--methods",
        "tinyhead",
        "--protocol",
        str(TINY_PROTOCOL),
        "--json",
        "out.json",
        cwd=tmp_path,
        path=[installed_plugin],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = json.loads((tmp_path / "out.json").read_text())
    (record,) = [
        r
        for r in (records if isinstance(records, list) else [records])
        if r["method"] == "tinyhead"
    ]
    for metric in ("precision_at_1", "mean_average_precision_at_r", "r_precision"):
        assert math.isfinite(record["metrics"][metric]), (metric, record["metrics"][metric])
    assert _repository_state() == state
