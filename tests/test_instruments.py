"""``tests/`` and ``benchmarks/`` never import each other: what both use is in ``instruments/``, which imports
neither (and is not shipped: the package never imports it)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the folder of each top-level package, and the packages it must not import
FORBIDDEN = {
    "tests": ("benchmarks",),
    "benchmarks": ("tests",),
    "instruments": ("tests", "benchmarks"),
    "lightning_numguard": ("tests", "benchmarks", "instruments"),
}


def imported(source: str) -> set[str]:
    """The top-level packages ``source`` imports, at any depth of the module (a function's lazy import included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
    return found


def test_the_scan_sees_every_form_of_import() -> None:
    source = "import benchmarks.op_count\nfrom tests import helpers\ndef f():\n    from instruments.syncs import X\n"
    assert imported(source) == {"benchmarks", "tests", "instruments"}
    assert imported("from . import sibling\nfrom .x import y\n") == set()


def test_no_folder_imports_what_it_must_not() -> None:
    wrong = []
    for folder, forbidden in FORBIDDEN.items():
        files = sorted((REPO / folder).rglob("*.py"))
        assert files, folder
        for path in files:
            bad = imported(path.read_text(encoding="utf-8")) & set(forbidden)
            wrong += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(bad)]
    assert not wrong, "\n".join(wrong)
