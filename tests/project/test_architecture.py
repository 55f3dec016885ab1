"""The layout is checked, not only described: the layers contract and the one-store-module
contract (pyproject.toml's ``[tool.importlinter]``), no import circle between any two
modules, no long function in any layer and no logic in a package's ``__init__``. (No module
over 600 lines: tests/project/test_code_size.py; no function too complex: ruff's C901 and
PLR0915, tests/project/test_code_style.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("harness",)
#: A function reads like the steps it runs; a longer one hides several concerns.
MAX_FUNCTION_LINES = 60


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


LAYERS = sorted(p.name for p in (REPO / "harness").iterdir() if (p / "__init__.py").is_file())


def _long_functions(source: str) -> list[str]:
    """``name:line (length)`` of each function of ``source`` over the limit."""
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                long.append(f"{node.name}:{node.lineno} ({length} lines)")
    return long


@pytest.mark.parametrize("layer", LAYERS)
def test_no_function_is_longer_than_60_lines(layer):
    long = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "harness" / layer).rglob("*.py"))
        if (found := _long_functions(path.read_text()))
    }
    assert long == {}


def test_the_length_check_finds_a_long_function():
    """The check above can fail: a 61-line function is reported, a 60-line one is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    source = f"def short():\n{body}\n\ndef long():\n{body}    y = 0\n"
    assert _long_functions(source) == ["long:63 (61 lines)"]


def test_every_layer_is_checked():
    assert set(LAYERS) == {
        "base",
        "cli",
        "components",
        "config",
        "engine",
        "methods",
        "reports",
        "store",
    }


def _init_definitions(source: str) -> list[str]:
    """``name:line`` of each function or class defined in a package ``__init__``."""
    return [
        f"{node.name}:{node.lineno}"
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]


def test_no_package_init_defines_a_function_or_class():
    """A package's ``__init__`` says what the package is and re-exports its public names
    by importing them; its functions and classes live in modules a reader finds by name.
    No lazy re-export either (a module-level ``__getattr__`` or ``__dir__``, PEP 562): a
    name imports the module that defines it, so go-to-definition finds it."""
    found = {
        str(path.relative_to(REPO)): names
        for path in sorted((REPO / "harness").rglob("__init__.py"))
        if (names := _init_definitions(path.read_text()))
    }
    assert found == {}


def test_no_module_defines_a_lazy_attribute_hook():
    """No module of ``harness/`` answers a missing attribute at import time (a module-level
    ``__getattr__`` or ``__dir__``): every name it offers is defined or imported in it."""
    found = {
        str(path.relative_to(REPO)): [
            f"{node.name}:{node.lineno}"
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")
        ]
        for path in sorted((REPO / "harness").rglob("*.py"))
    }
    assert {path: names for path, names in found.items() if names} == {}


#: Imports inside functions that harness/ may hold: each defers a measured start-up cost
#: (or waits for a library that loads the module while importing itself), and says which.
MAX_DEFERRED_IMPORTS = 60
DEFERRED_MARK = "# deferred:"


def _deferred_imports(source: str) -> tuple[int, list[int]]:
    """The number of import statements inside functions of ``source``, and the line of each
    one whose reason is not given: a ``# deferred:`` comment on a line of its block of
    consecutive imports or in the comment lines right above the block."""
    lines = source.splitlines()
    found: dict[int, ast.Import | ast.ImportFrom] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    found[inner.lineno] = inner
    covered = {n for node in found.values() for n in range(node.lineno, node.end_lineno + 1)}
    unexplained = []
    for line, node in sorted(found.items()):
        comments = [lines[n - 1] for n in range(line, node.end_lineno + 1)]
        above = line - 1
        while above in covered:
            comments.append(lines[above - 1])
            above -= 1
        while above >= 1 and lines[above - 1].strip().startswith("#"):
            comments.append(lines[above - 1])
            above -= 1
        if not any(DEFERRED_MARK in text for text in comments):
            unexplained.append(line)
    return len(found), unexplained


def test_imports_sit_at_the_top_of_each_module():
    """A module says what it depends on at its top; an import inside a function is one that
    would cost the start-up of commands that do not use it (``python -m harness --help``
    loads the parsers and the light command modules they import, whose command functions
    each import their work when the command runs), and its ``# deferred:`` comment says
    what it defers."""
    counts, unexplained = {}, {}
    for path in sorted((REPO / "harness").rglob("*.py")):
        count, lines = _deferred_imports(path.read_text())
        if count:
            counts[str(path.relative_to(REPO))] = count
        if lines:
            unexplained[str(path.relative_to(REPO))] = lines
    assert unexplained == {}
    assert sum(counts.values()) <= MAX_DEFERRED_IMPORTS, counts


def test_the_deferred_import_check_finds_an_unexplained_import():
    """The check above can fail: an import without the comment is reported; a commented
    block of imports, a comment on the line and a top-level import are not."""
    source = (
        "import os\n\n\n"
        "def explained():\n"
        "    # deferred: a library that costs 1 s\n"
        "    import a\n"
        "    from b import (\n"
        "        c,\n"
        "    )\n"
        "    import d  # deferred: 2 s\n\n\n"
        "def unexplained():\n"
        "    x = 1\n"
        "    import e\n"
        "    return x\n"
    )
    assert _deferred_imports(source) == (4, [15])


def environment_reads(tree: ast.AST) -> list[str]:
    """The variables a module reads from ``os.environ`` (``.get``, ``[...]``, ``os.getenv``);
    ``?`` where the name is not a literal."""

    def name(node: ast.AST | None) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if (func.attr == "get" and is_environ(func.value)) or func.attr == "getenv":
                found.append(name(node.args[0] if node.args else None))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            if isinstance(node.ctx, ast.Load):
                found.append(name(node.slice))
    return found


#: Reads of the process environment below the command line and the store, each with its
#: reason: the data root's default belongs to the datasets' loaders, a layer below the store;
#: the cluster's submission saves PYTHONPATH to restore it after putting the checkout first.
ENVIRONMENT_READS_BELOW = {
    "harness/components/data/base.py": ["DML_HARNESS_DATA"],
    "harness/engine/grid/cluster.py": ["PYTHONPATH"],
}


def test_settings_are_read_from_the_environment_only_by_the_cli_and_the_store():
    """Every other setting reaches the engine as a value or through
    :mod:`harness.store.environment`."""
    reads = {}
    for path in sorted((REPO / "harness").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(("harness/cli/", "harness/store/")):
            continue
        found = environment_reads(ast.parse(path.read_text()))
        if found:
            reads[relative] = found
    assert reads == ENVIRONMENT_READS_BELOW


def test_the_environment_read_check_finds_each_form_of_read():
    code = (
        'import os\nos.environ.get("A")\nos.environ["B"]\nos.getenv("C")\nos.environ["D"] = "1"\n'
    )
    assert environment_reads(ast.parse(code)) == ["A", "B", "C"]
