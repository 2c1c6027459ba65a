"""Every third-party module the package imports at load time is a declared dependency (issue 27: ``typing_extensions``
was imported and not declared); the optional ones (extras) are imported only where they are used."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_numguard"
#: import name -> distribution name, where they differ
DISTRIBUTIONS = {"pytorch_lightning": "pytorch-lightning", "lightning": "lightning"}
#: modules that import an extra at load time on purpose: the `lightning` package's own entry point
EXTRA_MODULES = {"lightning_numguard/doors/trainer/lightning_pkg.py": "lightning"}


def _load_time_imports(path: Path) -> set[str]:
    """Top-level third-party modules imported by ``path``'s module body (not in functions, not under ``try``)."""
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top != "lightning_numguard":
                found.add(top)
    return found


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def _list(toml: str, key: str) -> list[str]:
    """The strings of ``key = [...]`` in ``pyproject.toml`` (``tomllib`` is Python 3.11+; the package supports 3.10)."""
    match = re.search(rf"^{re.escape(key)} = \[(.*?)\]", toml, re.S | re.M)
    assert match, key
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", match.group(1)))


def test_every_load_time_import_is_a_declared_dependency() -> None:
    toml = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = _names(_list(toml, "dependencies"))
    extras = {name: _names(_list(toml, name)) for name in ("plot", "lightning")}
    assert "typing-extensions" in declared
    assert extras["plot"] == {"matplotlib"}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for module in _load_time_imports(path):
            dist = DISTRIBUTIONS.get(module, module).lower().replace("_", "-")
            if rel in EXTRA_MODULES:
                assert dist in declared | extras[EXTRA_MODULES[rel]], (rel, module)
            else:
                assert dist in declared, f"{rel} imports {module} at load time; declare it in pyproject.toml"
