"""The layout is checked, not only described: the layers contract and the one-store-module
contract (pyproject.toml's ``[tool.importlinter]``), no import circle between any two
modules, no long function or module in the engine and no long module among the plugins."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("harness",)
#: The engine's functions read like the steps they run; a longer one hides several concerns.
MAX_FUNCTION_LINES = 60
#: An engine module holds one piece of the engine, not a subsystem.
MAX_ENGINE_MODULE_LINES = 600
#: A plugin module holds one paper's head (or one of its pieces), not the whole paper.
MAX_PLUGIN_MODULE_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the project that ``module`` imports, at any depth of its code (a
    function-level import is still a dependency)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def test_the_layers_contract_holds():
    """``lint-imports`` over pyproject.toml's contracts: cli > engine > reports > store >
    config > methods > components > base, each importing only layers below it; and no
    layer but harness.store importing mlflow."""
    pytest.importorskip("importlinter", reason="import-linter is in the [test] extra")
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(REPO / "pyproject.toml")) == 0


def test_only_the_store_imports_mlflow():
    """The tracking store has one access module (harness.store): an ``import mlflow`` at
    any depth of any other module's code is a second one. Checked without import-linter
    too, so a checkout without the [test] extra still enforces it."""
    offenders = []
    for module, path in sorted(_modules().items()):
        if module == "harness.store" or module.startswith("harness.store."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [
                f"{module}:{node.lineno} {name}"
                for name in names
                if name == "mlflow" or name.startswith("mlflow.")
            ]
    assert offenders == []


def test_no_module_imports_itself_through_others():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted(m for m in graph if m in reachable(m))
    assert circles == [], f"modules in an import circle: {circles}"


def test_every_layer_is_a_folder_and_every_module_sits_in_one():
    """Nothing of the engine lives beside the layers: ``harness/`` holds only the entry
    points and the layer folders."""
    loose = sorted(
        p.name
        for p in (REPO / "harness").glob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    assert loose == []


@pytest.mark.parametrize("layer", ["engine", "reports"])
def test_no_engine_or_reports_function_is_longer_than_60_lines(layer):
    long = []
    for path in sorted((REPO / "harness" / layer).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(
                        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)"
                    )
    assert long == []


def test_no_engine_module_is_longer_than_600_lines():
    long = [
        f"{path.relative_to(REPO)} ({n} lines)"
        for path in sorted((REPO / "harness" / "engine").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_ENGINE_MODULE_LINES
    ]
    assert long == []


def test_no_plugin_module_is_longer_than_600_lines():
    """A paper's plugin file holds its head, variants and metadata; its pieces that grow
    (solvers, graphs, figures) live in modules of their own."""
    long = [
        f"{path.relative_to(REPO)} ({n} lines)"
        for path in sorted((REPO / "harness" / "methods").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_PLUGIN_MODULE_LINES
    ]
    assert long == []
