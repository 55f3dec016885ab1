"""Tests build on the harness's public names, as a plugin or a script would: no test imports
or touches a ``_``-named attribute of anything in ``harness``, and at most five places in
the tests replace an attribute of a harness module or class (``monkeypatch.setattr``, counted
where it is written), each with its reason in a comment.

The checks read every module under ``tests/`` with :mod:`ast`. A name counts as the
harness's when it is bound by an import from ``harness``, assigned from an expression built
on such a name (``loss = MetricLoss(...)``, ``for owner, name in HOOKS``) or annotated with
one. What an expression stands for is found by importing what it names and by the return
annotations of the functions it calls: ``atomic.os`` is :mod:`os`, ``build_parser()`` an
:class:`argparse.ArgumentParser`. Attributes of pytest's fixtures or of other libraries
(``torch._dynamo``, ``os._exit``) are not the harness's and pass; an object a test built
(``Trainer.build(...)``) is the test's own to change."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import textwrap
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


def _base(node: ast.AST) -> ast.AST:
    """What an expression is built on: ``a`` for ``a.b(c).d[e]``, the dict of ``{...}.items()``."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript | ast.Await | ast.Starred):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _root(node: ast.AST) -> ast.Name | None:
    """The name an expression is built on: ``a`` for ``a.b(c).d[e]``."""
    base = _base(node)
    return base if isinstance(base, ast.Name) else None


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
            self._note_import(node)
        bindings = [pair for node in ast.walk(self.tree) for pair in _bindings(node)]
        grown = True
        while grown:
            grown = False
            for target, value in bindings:
                for name in _names(target) if self.bound(value) else []:
                    if value not in self.derived.setdefault(name, []):
                        self.derived[name].append(value)
                        grown = True

    def _note_import(self, node: ast.AST) -> None:
        """The names an import from ``harness`` binds, with their dotted paths."""
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _from_harness(alias.name):
                    bound = alias.asname or alias.name.partition(".")[0]
                    self.imported[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _from_harness(node.module):
            for alias in node.names:
                self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def bound(self, node: ast.AST) -> bool:
        """Whether ``node`` is built on a harness-bound name (or holds one, for a tuple, a
        list, a set or a dict)."""
        base = _base(node)
        if isinstance(base, ast.Tuple | ast.List | ast.Set):
            return any(self.bound(elt) for elt in base.elts)
        if isinstance(base, ast.Dict):
            return any(self.bound(item) for item in (*base.keys, *base.values) if item is not None)
        return isinstance(base, ast.Name) and (base.id in self.imported or base.id in self.derived)

    def value(self, node: ast.AST, depth: int = 0) -> object:
        """What ``node`` stands for, as far as imports and annotations say: an object, an
        :class:`_Instance`, or ``_UNRESOLVED``."""
        if depth > 20 or isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
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


def _replaces_an_attribute(call: ast.Call) -> bool:
    """``monkeypatch.setattr`` or ``delattr`` (any ``x.setattr(...)``), or
    :mod:`unittest.mock`'s ``patch(...)`` and ``patch.object(...)``."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if isinstance(func, ast.Attribute) and func.attr == "object":
        owner = func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        name = "patch" if name == "patch" else ""
    return bool(call.args) and (
        name == "patch" or (isinstance(func, ast.Attribute) and name in ("setattr", "delattr"))
    )


def harness_patches(path: Path) -> list[str]:
    """Each ``monkeypatch.setattr`` (or ``delattr``, ``mock.patch``) in a test module that
    replaces an attribute of a harness module, class or module-level object (a registry),
    given as the object or as a ``"harness.x.y"`` string. An object the test made itself
    (``trainer = Trainer.build(...)``, a call's result) is the test's own, not counted."""
    module = _read(path)
    found = []
    for node in ast.walk(module.tree):
        if not (isinstance(node, ast.Call) and _replaces_an_attribute(node)):
            continue
        target = node.args[0]
        text = _string(target)
        if (text is not None and _DOTTED_HARNESS.fullmatch(text)) or (
            module.of_harness(target) and not isinstance(module.value(target), _Instance)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node.func)}({ast.unparse(target)}, ...)")
    return sorted(found, key=lambda where: int(where.partition(":")[0]))


def _test_modules() -> list[Path]:
    return sorted((REPO / "tests").rglob("*.py"))


def test_no_test_imports_or_touches_a_private_harness_name():
    offenders = {
        str(path.relative_to(REPO)): uses
        for path in _test_modules()
        if (uses := private_uses(path))
    }
    assert not offenders, f"tests reaching past the harness's public names: {offenders}"


def test_at_most_five_places_in_the_tests_replace_a_harness_attribute():
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
    sample.write_text(textwrap.dedent(text))
    return sample


def _lines(found: list[str]) -> list[int]:
    return [int(where.partition(":")[0]) for where in found]


def test_the_private_name_check_finds_each_way_in(tmp_path):
    """The check can fail: imports, attributes of modules, classes, registries and objects,
    dotted strings and (object, name) pairs are each reported."""
    sample = _sample(
        tmp_path,
        """\
        import harness.base.atomic as atomic
        from harness.cli.run import _check_one_graph, cmd_run
        from harness.methods import METHODS
        from harness.components.losses import MetricLoss
        from harness.methods import sam_tuples
        import harness.engine._private
        def test_x(monkeypatch):
            atomic._HOST
            METHODS._entries
            MetricLoss._mine
            loss = MetricLoss([]); loss._mine
            monkeypatch.setattr(sam_tuples, "_random_order", None)
            monkeypatch.setattr("harness.methods.sam_tuples._random_order", None)
            draws = ((sam_tuples, "_random_index"),)
            getattr(cmd_run, "_cache")
        """,
    )
    assert _lines(private_uses(sample)) == [2, 6, 8, 9, 10, 11, 12, 13, 14, 15]


def test_the_private_name_check_leaves_other_libraries_alone(tmp_path):
    """Private attributes of the standard library, torch, pytest's fixtures and of objects a
    harness function is annotated to return (``build_parser() -> ArgumentParser``) pass."""
    sample = _sample(
        tmp_path,
        """\
        import os, torch
        import harness.base.atomic as atomic
        from harness.cli.main import build_parser
        from harness.methods import METHODS
        def test_x(capsys, monkeypatch):
            torch._dynamo.reset(); os._exit; capsys._capture
            atomic.os._exit
            METHODS.__class__, METHODS.__doc__
            monkeypatch.setattr(os, "_exit", None)
            parser = build_parser(); parser._actions; build_parser()._actions
        """,
    )
    assert private_uses(sample) == []


def test_the_patch_count_finds_modules_classes_and_strings_only(tmp_path):
    """Harness modules, classes and module-level objects, given as objects, through a loop or
    as dotted strings, count; the standard library (also reached through a harness module)
    and an object the test built do not."""
    sample = _sample(
        tmp_path,
        """\
        import os
        import harness.base.atomic as atomic
        from harness.engine.run import training
        from harness.engine.run.trainer import Trainer
        from harness.methods import METHODS, sam_tuples
        from harness.methods.plain import PlainHead
        def test_x(monkeypatch):
            monkeypatch.setattr(training, "run_training", None)
            monkeypatch.setattr(PlainHead, "revision", 2)
            monkeypatch.setattr("harness.cli.run.check_dataset", None)
            monkeypatch.setattr(METHODS, "kind", "x")
            for (owner, name), section in {(sam_tuples, "random_order"): "draws"}.items():
                monkeypatch.setattr(owner, name, None)
            monkeypatch.setattr(atomic.os, "fdopen", None)
            monkeypatch.setattr(os, "replace", None)
            monkeypatch.setattr("os.sched_getaffinity", None)
            trainer = Trainer.from_config(None, None)
            monkeypatch.setattr(trainer, "train_step", None)
            with mock.patch("harness.engine.run.training.run_training"), mock.patch.object(
                PlainHead, "revision", 2
            ):
                monkeypatch.delattr(training, "run_training")
        """,
    )
    assert _lines(harness_patches(sample)) == [8, 9, 10, 11, 13, 19, 19, 22]
