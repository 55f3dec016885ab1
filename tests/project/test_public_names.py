"""Tests build on the harness's public names, as a plugin or a script would: no test imports
or touches a ``_``-named attribute of anything in ``harness``, and only a handful of tests
replace an attribute of a harness module or class (``monkeypatch.setattr``), each saying why.

The checks read every module under ``tests/`` with :mod:`ast`. A name counts as the
harness's when it is bound by an import from ``harness``, assigned from an expression built
on such a name (``loss = MetricLoss(...)``, ``head = METHODS.build(...)``) or annotated with
one; whether an attribute chain of an imported name still lies in the harness
(``atomic.os`` is :mod:`os`) is decided by importing it. Attributes of pytest's fixtures or of
other libraries (``torch._dynamo``, ``os._exit``) are not the harness's and pass."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Attribute replacements on the harness the suite allows; each one carries its reason.
MAX_HARNESS_PATCHES = 5
_DOTTED_HARNESS = re.compile(r"harness(\.[A-Za-z_]\w*)+")
_UNRESOLVED = object()


class _Instance:
    """An object of class ``cls``, as a call of the class or of a function annotated to
    return one makes."""

    def __init__(self, cls: type):
        self.cls = cls


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _from_harness(module: object) -> bool:
    return isinstance(module, str) and (module == "harness" or module.startswith("harness."))


def _root(node: ast.AST) -> ast.Name | None:
    """The name an expression is built on: ``a`` for ``a.b(c).d[e]``."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript | ast.Await | ast.Starred):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node if isinstance(node, ast.Name) else None


def _names(target: ast.AST) -> list[str]:
    """The plain names an assignment target binds (``a`` and ``b`` of ``a, (b, c.d)``)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List | ast.Starred):
        elts = [target.value] if isinstance(target, ast.Starred) else target.elts
        return [name for elt in elts for name in _names(elt)]
    return []


def _lookup(parts: list[str]) -> object:
    """Import the longest module prefix of ``parts`` and walk the rest as attributes."""
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            value = getattr(value, name, _UNRESOLVED)
            if value is _UNRESOLVED:
                return _UNRESOLVED
        return value
    return _UNRESOLVED


def _called(function: object) -> object:
    """What calling ``function`` gives, as far as its annotation says: an instance of a class
    (the class itself, or the class a function's return annotation names)."""
    if isinstance(function, type):
        return _Instance(function)
    try:
        returned = typing.get_type_hints(function).get("return", _UNRESOLVED)
    except Exception:  # an annotation that does not evaluate says nothing
        return _UNRESOLVED
    return _Instance(returned) if isinstance(returned, type) else _UNRESOLVED


def _same(a: object, b: object) -> bool:
    if isinstance(a, _Instance) and isinstance(b, _Instance):
        return a.cls is b.cls
    return a is b


def _is_harness_object(value: object) -> bool:
    """A harness module, a class or function defined in one, or an instance of such a class."""
    if isinstance(value, _Instance):
        return _from_harness(value.cls.__module__)
    if isinstance(value, types.ModuleType):
        return _from_harness(value.__name__)
    return _from_harness(getattr(value, "__module__", None) or type(value).__module__)


def _bindings(node: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, value) pairs a statement binds: assignments, ``with ... as``, ``for`` loops
    and parameters or variables annotated with a type."""
    if isinstance(node, ast.Assign):
        return [(target, node.value) for target in node.targets]
    if isinstance(node, ast.AnnAssign):
        return [(node.target, node.value if node.value is not None else node.annotation)]
    if isinstance(node, ast.NamedExpr):
        return [(node.target, node.value)]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [(node.optional_vars, node.context_expr)]
    if isinstance(node, ast.For | ast.comprehension):
        return [(node.target, node.iter)]
    if isinstance(node, ast.arg) and node.annotation is not None:
        return [(ast.Name(node.arg), node.annotation)]
    return []


@dataclass
class _Module:
    """One test module: the names it binds to the harness, and what an expression built on
    one of them stands for."""

    tree: ast.Module
    #: Name -> dotted import path, for names bound by an import from ``harness``.
    imported: dict[str, str] = field(default_factory=dict)
    #: Name -> the expressions assigned to it that are built on a harness-bound name.
    derived: dict[str, list[ast.AST]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _from_harness(alias.name):
                        bound = alias.asname or alias.name.partition(".")[0]
                        self.imported[bound] = alias.name if alias.asname else bound
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                if _from_harness(node.module):
                    for alias in node.names:
                        self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        bindings = [pair for node in ast.walk(self.tree) for pair in _bindings(node)]
        grown = True
        while grown:
            grown = False
            for target, value in bindings:
                for name in _names(target) if self.bound(value) else []:
                    if value not in self.derived.setdefault(name, []):
                        self.derived[name].append(value)
                        grown = True

    def bound(self, node: ast.AST) -> bool:
        """Whether ``node`` is built on a harness-bound name (or holds one, for a tuple)."""
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(self.bound(elt) for elt in node.elts)
        root = _root(node)
        return root is not None and (root.id in self.imported or root.id in self.derived)

    def value(self, node: ast.AST, depth: int = 0) -> object:
        """What ``node`` stands for, as far as imports and annotations say: an object, an
        :class:`_Instance`, or ``_UNRESOLVED``."""
        if depth > 20 or isinstance(node, ast.Tuple | ast.List | ast.Set):
            return _UNRESOLVED
        if isinstance(node, ast.Name):
            if node.id in self.derived:
                first, *others = (self.value(e, depth + 1) for e in self.derived[node.id])
                return first if all(_same(first, other) for other in others) else _UNRESOLVED
            return (
                _lookup(self.imported[node.id].split("."))
                if node.id in self.imported
                else _UNRESOLVED
            )
        if isinstance(node, ast.Attribute):
            owner = self.value(node.value, depth + 1)
            if owner is _UNRESOLVED or isinstance(owner, _Instance):
                return _UNRESOLVED
            return getattr(owner, node.attr, _UNRESOLVED)
        if isinstance(node, ast.Call):
            function = self.value(node.func, depth + 1)
            return _UNRESOLVED if function is _UNRESOLVED else _called(function)
        return _UNRESOLVED

    def of_harness(self, node: ast.AST) -> bool:
        """Whether ``node`` is a harness module, class, function or object: built on a
        harness-bound name, and not found to be something else (``atomic.os``,
        ``build_parser()``, an :class:`argparse.ArgumentParser`)."""
        if not self.bound(node):
            return False
        value = self.value(node)
        return value is _UNRESOLVED or _is_harness_object(value)


@functools.cache
def _read(path: Path) -> _Module:
    return _Module(ast.parse(path.read_text(encoding="utf-8")))


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dotted_private(text: str | None) -> bool:
    """A dotted harness path naming a private part: ``"harness.cli.run._check"``."""
    return (
        text is not None
        and _DOTTED_HARNESS.fullmatch(text) is not None
        and any(_private(part) for part in text.split("."))
    )


def private_uses(path: Path) -> list[str]:
    """Each place in a test module that imports or touches a ``_``-named harness attribute,
    as ``line: what``."""
    module = _read(path)
    found: list[str] = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _from_harness(node.module):
            found += [
                f"{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if _private(a.name) or _dotted_private(node.module)
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}" for a in node.names if _dotted_private(a.name)
            ]
        elif (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and module.of_harness(node.value)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call | ast.Tuple | ast.List):
            items = (
                [*node.args, *(k.value for k in node.keywords)]
                if isinstance(node, ast.Call)
                else node.elts
            )
            found += [
                f"{node.lineno}: {ast.unparse(node)}"
                for i, item in enumerate(items)
                if _dotted_private(_string(item))
                or (i > 0 and _private(_string(item) or "") and module.of_harness(items[i - 1]))
            ]
    return sorted(set(found), key=lambda where: int(where.partition(":")[0]))


def harness_patches(path: Path) -> list[str]:
    """Each ``monkeypatch.setattr`` (any ``x.setattr(target, ...)``) in a test module that
    replaces an attribute of a harness module, class or object, given as the object or as a
    ``"harness.x.y"`` string."""
    module = _read(path)
    found = []
    for node in ast.walk(module.tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "setattr"
            and node.args
        ):
            continue
        target = node.args[0]
        text = _string(target)
        if (text is not None and _DOTTED_HARNESS.fullmatch(text)) or module.of_harness(target):
            found.append(f"{node.lineno}: {ast.unparse(node.func)}({ast.unparse(target)}, ...)")
    return found


def _test_modules() -> list[Path]:
    return sorted((REPO / "tests").rglob("*.py"))


def test_no_test_imports_or_touches_a_private_harness_name():
    offenders = {
        str(path.relative_to(REPO)): uses
        for path in _test_modules()
        if (uses := private_uses(path))
    }
    assert not offenders, f"tests reaching past the harness's public names: {offenders}"


def test_at_most_five_tests_replace_an_attribute_of_the_harness():
    patches = {
        str(path.relative_to(REPO)): found
        for path in _test_modules()
        if (found := harness_patches(path))
    }
    count = sum(len(found) for found in patches.values())
    assert count <= MAX_HARNESS_PATCHES, f"{count} harness attributes replaced: {patches}"


def test_every_harness_patch_gives_its_reason():
    """A remaining replacement says why in a comment on its line or the line above."""
    silent = []
    for path in _test_modules():
        lines = path.read_text(encoding="utf-8").splitlines()
        for where in harness_patches(path):
            line = int(where.partition(":")[0])
            if "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#"):
                silent.append(f"{path.relative_to(REPO)}:{where}")
    assert not silent, f"harness patches without a reason: {silent}"


def _sample(tmp_path: Path, text: str) -> Path:
    sample = tmp_path / "test_sample.py"
    sample.write_text(text)
    return sample


def test_the_private_name_check_finds_each_way_in(tmp_path):
    """The check can fail: imports, attributes of modules, classes, registries and objects,
    dotted strings and (object, name) pairs are each reported."""
    sample = _sample(
        tmp_path,
        "import harness.base.atomic as atomic\n"
        "from harness.cli.run import _check_one_graph, cmd_run\n"
        "from harness.base.registry import METHODS\n"
        "from harness.components.losses import MetricLoss\n"
        "from harness.methods import sam_tuples\n"
        "import harness.engine._private\n"
        "def test_x(monkeypatch):\n"
        "    atomic._HOST\n"
        "    METHODS._entries\n"
        "    MetricLoss._mine\n"
        "    loss = MetricLoss(); loss._mine\n"
        "    monkeypatch.setattr(sam_tuples, '_random_order', None)\n"
        "    monkeypatch.setattr('harness.methods.sam_tuples._random_order', None)\n"
        "    draws = ((sam_tuples, '_random_index'),)\n",
    )
    assert [where.partition(":")[0] for where in private_uses(sample)] == [
        "2",
        "6",
        "8",
        "9",
        "10",
        "11",
        "12",
        "13",
        "14",
    ]


def test_the_private_name_check_leaves_other_libraries_alone(tmp_path):
    sample = _sample(
        tmp_path,
        "import os, torch\n"
        "import harness.base.atomic as atomic\n"
        "from harness.base.registry import METHODS\n"
        "def test_x(capsys, monkeypatch):\n"
        "    torch._dynamo.reset(); os._exit; capsys._capture\n"
        "    atomic.os._exit\n"
        "    METHODS.__class__, METHODS.__doc__\n"
        "    monkeypatch.setattr(os, '_exit', None)\n",
    )
    assert private_uses(sample) == []


def test_the_patch_count_finds_objects_and_strings_but_not_other_libraries(tmp_path):
    sample = _sample(
        tmp_path,
        "import os\n"
        "import harness.base.atomic as atomic\n"
        "from harness.engine import training\n"
        "from harness.methods.plain import PlainHead\n"
        "def test_x(monkeypatch):\n"
        "    monkeypatch.setattr(training, 'run_training', None)\n"
        "    monkeypatch.setattr(PlainHead, 'revision', 2)\n"
        "    monkeypatch.setattr('harness.cli.run.check_dataset', None)\n"
        "    monkeypatch.setattr(atomic.os, 'fdopen', None)\n"
        "    monkeypatch.setattr(os, 'replace', None)\n"
        "    monkeypatch.setattr('os.sched_getaffinity', None)\n",
    )
    assert [where.partition(":")[0] for where in harness_patches(sample)] == ["6", "7", "8"]
