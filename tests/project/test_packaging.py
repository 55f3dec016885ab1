"""pyproject.toml: every package and data folder ships in a (non-editable) install, every
third-party module the harness imports is a declared dependency, and the lock
(requirements/lock.txt, ``nox -s lock``) pins each requirement within its range, and is what
the README's install lines (and so CI's ``.ci/run``) install with."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = ROOT / "requirements" / "lock.txt"


def test_every_package_and_data_folder_is_listed():
    from setuptools import find_packages

    setup = PYPROJECT["tool"]["setuptools"]
    assert set(find_packages(str(ROOT), include=["harness*"])) <= set(setup["packages"])
    # The data folders stay where they are in the checkout and ship inside harness.
    assert setup["package-dir"] == {
        "harness._protocols": "protocols",
        "harness._published": "results/published",
    }
    for package, folder in setup["package-dir"].items():
        assert package in setup["packages"] and (ROOT / folder).is_dir()
        patterns = setup["package-data"][package]
        assert any(True for pattern in patterns for _ in (ROOT / folder).glob(pattern))


def test_the_data_folders_are_found_from_any_working_directory(tmp_path, monkeypatch):
    from harness.config.catalog import protocol_dir
    from harness.config.grids import load_grid
    from harness.config.protocol_files import load_protocol
    from harness.reports.tables import load_published, locate_published, published_dir

    monkeypatch.chdir(tmp_path)
    assert (
        protocol_dir() == ROOT / "protocols" and published_dir() == ROOT / "results" / "published"
    )
    assert load_protocol("smoke").name == "smoke"
    grid = load_grid("diml-table1")
    assert locate_published(grid.published_file) == ROOT / grid.published_file
    assert not load_published(Path(grid.published_file), grid.published_tables).empty


def _imported_modules(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def _requirement_name(spec: str) -> str:
    for stop in "<>=!~[; ":
        spec = spec.split(stop)[0]
    return spec.strip().lower().replace("_", "-")


def test_every_imported_third_party_module_is_a_declared_dependency():
    declared = {_requirement_name(d) for d in PYPROJECT["project"]["dependencies"]}
    modules = _imported_modules(ROOT / "harness")
    third_party = sorted(m for m in modules if m not in sys.stdlib_module_names and m != "harness")
    providers = packages_distributions()
    undeclared = []
    for module in third_party:
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        if not dists:
            pytest.fail(f"{module} is imported but not installed")
        if not dists & declared:
            undeclared.append(f"{module} ({', '.join(sorted(dists))})")
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"


def _lock_pins() -> dict[str, Version]:
    """``{name: version}`` of the lock's ``name==version`` lines (the text after ``#`` left out)."""
    pins = {}
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, sep, version = text.partition("==")
        assert sep and name.strip() and " " not in version, f"not a name==version pin: {line!r}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def test_the_lock_pins_every_requirement_within_its_range():
    """Each requirement of [project] dependencies and of the test extra has one pin in the
    lock, and the pinned version satisfies the range pyproject.toml gives."""
    pins = _lock_pins()
    assert len(pins) >= 100
    requirements = [*PYPROJECT["project"]["dependencies"]]
    requirements += PYPROJECT["project"]["optional-dependencies"]["test"]
    outside = []
    for requirement in map(Requirement, requirements):
        name = canonicalize_name(requirement.name)
        if name not in pins:
            outside.append(f"{requirement} (not pinned)")
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            outside.append(f"{requirement} (pinned {pins[name]})")
    assert not outside, f"the lock does not satisfy pyproject.toml: {outside}"
    assert "dml-harness" not in pins  # the project itself is the -e install


def test_the_lock_names_the_command_that_made_it():
    header = []
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert any(line.strip("# ") == "nox -s lock" for line in header), header


def test_the_readme_install_lines_use_the_lock():
    """The run and test commands (the second is what .ci/run runs) install with the lock."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for marker, extra in (("<!-- run-command -->", "."), ("<!-- test-command -->", "'.[test]'")):
        command = readme.split(marker, 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
        assert f"pip install -c requirements/lock.txt -e {extra} " in command, command
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
