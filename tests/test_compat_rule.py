"""The ``_compat`` rule, enforced: private names of other code and frame walks live in ``_compat.py`` only.

Every ``.py`` file of the package is parsed; anywhere but ``lightning_numguard/_compat.py`` these fail,
named by ``file:line`` and the expression:

* ``X._name`` (one leading underscore, or a mangled ``__name``; not a dunder) where ``X`` is not ``self``,
  ``cls``, ``super()`` or ``type(self)``: a private attribute of a foreign object (``torch._C``,
  ``module._modules``, ``guard._recovery``...); ``getattr``/``hasattr``/``setattr``/``delattr`` with a literal
  private name count too;
* ``f_locals``, ``f_back``, ``sys._getframe``, ``inspect.currentframe``/``stack``...: a walk over the caller's
  frames (``_compat.first_frame`` is the one walk outwards);
* ``import torch._C``, ``from torch.x._y import z``, ``from torch import _C``: a private name of another package
  (the package's own private modules, ``from lightning_numguard.callbacks.distributed import _distributed``, are fine).

namedtuple's public underscore API (``_replace``, ``_asdict``, ``_fields``...) is allowed; anything else only
through :data:`ALLOWED`, each entry saying why it cannot go through ``_compat``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_numguard"
PACKAGE_NAME = PACKAGE.name
COMPAT = "lightning_numguard/_compat.py"

#: ``(path, expression) -> why it cannot go through _compat``. Keep it small; every entry must still match.
ALLOWED: dict[tuple[str, str], str] = {}

OWN_RECEIVERS = frozenset({"self", "cls"})
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})
ATTRIBUTE_BUILTINS = frozenset({"getattr", "hasattr", "setattr", "delattr"})
FRAME_ATTRIBUTES = frozenset({"f_locals", "f_back", "_getframe", "_current_frames"})
INSPECT_FRAME_FUNCTIONS = frozenset(
    {"currentframe", "stack", "trace", "getouterframes", "getinnerframes", "getframeinfo"}
)
FRAME_WALK = "a frame walk: use a `_compat` frame function"


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    expression: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: `{self.expression}` ({self.why})"


def is_private(name: str) -> bool:
    """``_x`` and ``__x`` are private; ``__x__`` (a dunder) and ``_`` are not."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def _is_own(receiver: ast.expr, classes: frozenset[str] = frozenset()) -> bool:
    """``self``, ``cls``, ``super()``, ``type(self)`` or an enclosing class by name: code of the object itself."""
    if isinstance(receiver, ast.Name):
        return receiver.id in OWN_RECEIVERS or receiver.id in classes
    if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name):
        if receiver.func.id == "super" and not receiver.args:
            return True
        return receiver.func.id == "type" and len(receiver.args) == 1 and _is_own(receiver.args[0])
    return False


def _private_module(module: str) -> bool:
    """A foreign dotted module path with a private part (``torch._C``, ``torch.utils._pytree``)."""
    parts = module.split(".")
    return parts[0] != PACKAGE_NAME and any(is_private(p) for p in parts)


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.found: list[Violation] = []
        self.classes: frozenset[str] = frozenset()  # the classes whose body the visitor is in

    def add(self, node: ast.AST, why: str) -> None:
        self.found.append(Violation(self.path, getattr(node, "lineno", 0), ast.unparse(node), why))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer, self.classes = self.classes, self.classes | {node.name}
        self.generic_visit(node)
        self.classes = outer

    def _attribute_breach(self, node: ast.Attribute) -> str | None:
        if node.attr in FRAME_ATTRIBUTES:
            return FRAME_WALK
        if isinstance(node.value, ast.Name) and node.value.id == "inspect" and node.attr in INSPECT_FRAME_FUNCTIONS:
            return FRAME_WALK
        if is_private(node.attr) and node.attr not in NAMEDTUPLE_API and not _is_own(node.value, self.classes):
            return "a private attribute of a foreign object"
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        why = self._attribute_breach(node)
        if why is None:
            self.generic_visit(node)
            return
        # ``torch._C._nn._parse_to`` is one breach, named in full: skip the breaching prefixes below it.
        inner = node.value
        while isinstance(inner, ast.Attribute) and self._attribute_breach(inner) is not None:
            inner = inner.value
        self.add(node, why)
        self.visit(inner)

    def visit_Call(self, node: ast.Call) -> None:
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id in ATTRIBUTE_BUILTINS and len(args) >= 2:
            name = args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and not _is_own(args[0], self.classes):
                if name.value in FRAME_ATTRIBUTES:
                    self.add(node, FRAME_WALK)
                elif is_private(name.value) and name.value not in NAMEDTUPLE_API:
                    self.add(node, "a private attribute of a foreign object, by name")
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        if any(_private_module(alias.name) for alias in node.names):
            self.add(node, "a private module of another package")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or node.module.split(".")[0] == PACKAGE_NAME:
            return  # the package's own modules, private or not
        if _private_module(node.module):
            self.add(node, "a private module of another package")
        elif any(is_private(a.name) for a in node.names):
            self.add(node, "a private name of another package")
        elif node.module == "inspect" and any(a.name in INSPECT_FRAME_FUNCTIONS for a in node.names):
            self.add(node, FRAME_WALK)


def violations(source: str, path: str = "<snippet>") -> list[Violation]:
    """Every breach of the rule in ``source`` (the file at ``path``), in source order."""
    checker = _Checker(path)
    checker.visit(ast.parse(source, filename=path))
    return sorted(checker.found, key=lambda v: (v.line, v.expression))


def package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def package_violations() -> list[Violation]:
    out: list[Violation] = []
    for file in package_files():
        rel = file.relative_to(REPO).as_posix()
        if rel != COMPAT:
            out += violations(file.read_text(encoding="utf-8"), rel)
    return out


# --------------------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(
    ("source", "expression"),
    [
        ("import torch\ntorch._C._nn._parse_to('cpu')", "torch._C._nn._parse_to"),
        ("import torch\nx = torch._C", "torch._C"),
        ("import sys\nf = sys._getframe(1)", "sys._getframe"),
        ("def f(frame):\n    return frame.f_locals.get('self')", "frame.f_locals"),
        ("def f(frame):\n    while frame is not None:\n        frame = frame.f_back", "frame.f_back"),
        ("import inspect\nf = inspect.currentframe()", "inspect.currentframe"),
        ("from inspect import currentframe", "from inspect import currentframe"),
        ("def f(opt):\n    return opt._step_supports_amp_scaling", "opt._step_supports_amp_scaling"),
        (
            "def f(opt):\n    return getattr(opt, '_step_supports_amp_scaling', False)",
            "getattr(opt, '_step_supports_amp_scaling', False)",
        ),
        ("def f(m):\n    setattr(m, '_x', 1)", "setattr(m, '_x', 1)"),
        ("def f(module):\n    return len(module._modules)", "module._modules"),
        ("def f(guard):\n    return guard._recovery.snapshot", "guard._recovery"),
        ("def f(guard):\n    return guard._inspector._start_buffer_map", "guard._inspector._start_buffer_map"),
        ("class A:\n    def f(self, other):\n        return other._x", "other._x"),
        ("class A:\n    def f(self):\n        return self.child._x", "self.child._x"),
        ("def f(x):\n    return x.__secret", "x.__secret"),
        ("class C:\n    _n = 0\n\n\ndef f():\n    return C._n", "C._n"),
        ("def f(counter):\n    return counter._hit(f.__code__)", "counter._hit"),
        ("import torch._C", "import torch._C"),
        ("import torch.utils._pytree as pytree", "import torch.utils._pytree as pytree"),
        ("from torch.utils._pytree import tree_map", "from torch.utils._pytree import tree_map"),
        ("from torch import _C", "from torch import _C"),
        (
            "from pytorch_lightning.loops import _TrainingEpochLoop",
            "from pytorch_lightning.loops import _TrainingEpochLoop",
        ),
        ("from sys import _getframe", "from sys import _getframe"),
    ],
)
def test_the_checker_catches(source: str, expression: str) -> None:
    found = violations(source)
    assert [v.expression for v in found] == [expression], found


@pytest.mark.parametrize(
    "source",
    [
        "class A:\n    def f(self):\n        return self._modules",
        "class A:\n    @classmethod\n    def f(cls):\n        return cls._registry",
        "class A(B):\n    def f(self):\n        return super()._hook()",
        "class A:\n    def f(self):\n        return type(self)._cache",
        "class A:\n    def f(self):\n        return getattr(self, '_x', None)",
        "def f(p):\n    return p._replace(x=1)._asdict(), p._fields",
        "def f(obj):\n    return hasattr(obj, '_fields')",
        "def f(func):\n    return getattr(func, '__name__', ''), func.__module__, func.__dict__",
        "from lightning_numguard.callbacks.distributed import _distributed\n_distributed.reduce_max",
        "from lightning_numguard.core._private import thing",
        "from . import _sibling\nfrom ._sibling import _helper",
        "import lightning_numguard._compat as c\nc.nn_bindings()",
        "from __future__ import annotations",
        "def f(frame):\n    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals",
        "for _ in range(3):\n    pass",
        "class C:\n    _n = 0\n\n    def f(self):\n        C._n += 1",
        "class Outer:\n    class Inner:\n        def f(self):\n            return Outer._registry",
        "import torch\ntorch.stack([])",
    ],
)
def test_the_checker_allows(source: str) -> None:
    assert violations(source) == []


def test_a_violation_names_file_line_and_expression() -> None:
    (v,) = violations("import torch\n\n\nx = torch._C\n", "lightning_numguard/core/x.py")
    assert str(v) == "lightning_numguard/core/x.py:4: `torch._C` (a private attribute of a foreign object)"


# ------------------------------------------------------------------------------- the package


def test_the_scan_sees_the_whole_package() -> None:
    """Control: the files exist and the scan reads ``_compat.py``'s own (allowed) private accesses."""
    rels = {p.relative_to(REPO).as_posix() for p in package_files()}
    assert {COMPAT, "lightning_numguard/engine/flow.py", "lightning_numguard/doors/trainer/callback.py"} <= rels
    assert violations((PACKAGE / "_compat.py").read_text(encoding="utf-8"), COMPAT), "the checker sees nothing"


def test_every_private_access_and_frame_walk_goes_through_compat() -> None:
    found = [v for v in package_violations() if (v.path, v.expression) not in ALLOWED]
    assert not found, "move these into lightning_numguard/_compat.py:\n" + "\n".join(map(str, found))


def test_the_exceptions_are_still_needed() -> None:
    """An ``ALLOWED`` entry with no violation left must leave the list."""
    found = package_violations()
    used = {(v.path, v.expression) for v in found}
    assert not set(ALLOWED) - used, sorted(set(ALLOWED) - used)
