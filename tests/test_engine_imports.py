"""The engine needs only torch and the standard library: every module outside the front doors imports with
Lightning blocked.

Each check runs in a fresh interpreter whose ``sys.meta_path`` refuses every Lightning
distribution (``pytorch_lightning``, ``lightning``, ``lightning_fabric``). The modules are
discovered from the files under ``lightning_numguard`` (sub-packages included), leaving out the front doors
(``lightning_numguard/doors``, the only folder allowed to import Lightning) and the public modules that re-export
a door's class (``lightning_numguard.lightning``, ``lightning_numguard.callbacks``, ``lightning_numguard.fabric``),
so a new module is checked without editing this file.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE_DIR = REPO / "lightning_numguard"
BLOCKED = ("pytorch_lightning", "lightning", "lightning_fabric")
#: the front doors' folder, and the public modules that re-export a door's class
DOORS = ("doors", "lightning", "callbacks", "fabric")


def discover_core_modules(core_dir: Path, doors: tuple[str, ...] = DOORS) -> dict[str, Path]:
    """Map each module under ``core_dir`` to its file, as dotted names relative to it, the doors left out.

    ``tree.py`` is ``"tree"``; a sub-package ``detect/opguard/__init__.py`` is ``"detect.opguard"``
    and ``detect/opguard/rules.py`` is ``"detect.opguard.rules"``. The package's own ``__init__`` is left
    out: importing any module below runs it anyway.
    """
    found: dict[str, Path] = {}
    for path in sorted(core_dir.rglob("*.py")):
        parts = list(path.relative_to(core_dir).with_suffix("").parts)
        if "__pycache__" in parts or parts[0] in doors or parts == ["__main__"]:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            found[".".join(parts)] = path.resolve()
    return found


CORE_MODULES = discover_core_modules(CORE_DIR)

BLOCKER = textwrap.dedent(
    f"""
    import importlib.abc
    import sys

    BLOCKED = {BLOCKED!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"blocked by the test: {{name}}")
            return None

    assert not any(m.partition(".")[0] in BLOCKED for m in sys.modules), "already imported"
    sys.meta_path.insert(0, Blocker())
    """
)


def _ok_lines(stdout: str) -> dict[str, Path]:
    """``{module: file}`` from the ``OK <module> <file>`` lines a check prints."""
    lines = (line.split(" ", 2) for line in stdout.splitlines() if line.startswith("OK "))
    return {name: Path(file).resolve() for _, name, file in lines}


def _run(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(body)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_blocker_blocks_lightning() -> None:
    """Negative control: the same interpreter set-up cannot import any Lightning distribution."""
    result = _run(
        """
        failed = []
        for name in ("pytorch_lightning", "lightning", "lightning_fabric", "pytorch_lightning.callbacks"):
            try:
                __import__(name)
            except ImportError as err:
                assert "blocked by the test" in str(err), err
                failed.append(name)
        print("BLOCKED", ",".join(failed))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "BLOCKED pytorch_lightning,lightning,lightning_fabric,pytorch_lightning.callbacks" in result.stdout


def test_torch_still_imports_under_the_blocker() -> None:
    """Control: the blocker only blocks Lightning, so a core failure below is not torch's."""
    result = _run("import torch\nprint('TORCH', torch.ones(2).sum().item())\n")
    assert result.returncode == 0, result.stderr
    assert "TORCH 2.0" in result.stdout


def test_discovery_finds_the_known_core_modules() -> None:
    """The discovery itself can fail: it must see the modules every layout has."""
    assert CORE_MODULES, f"no module found under {CORE_DIR}"
    wanted = {"tree", "detect.checks", "state.snapshot", "detect.watch", "detect.opguard"}
    assert wanted <= set(CORE_MODULES), sorted(CORE_MODULES)
    assert not any(name.startswith(DOORS) for name in CORE_MODULES), sorted(CORE_MODULES)
    for name, file in CORE_MODULES.items():
        assert file.is_file() and file.is_relative_to(CORE_DIR), (name, file)


def test_discovery_walks_sub_packages(tmp_path: Path) -> None:
    """A sub-package counts as its ``__init__`` plus each of its modules; caches are skipped."""
    core = tmp_path / "pkg"
    (core / "opguard").mkdir(parents=True)
    (core / "doors").mkdir()
    (core / "__pycache__").mkdir()
    for rel in ("__init__.py", "tree.py", "opguard/__init__.py", "opguard/rules.py", "__pycache__/stale.py"):
        (core / rel).write_text("")
    (core / "doors" / "trainer.py").write_text("")
    (core / "lightning.py").write_text("")
    assert discover_core_modules(core) == {
        "tree": (core / "tree.py").resolve(),
        "opguard": (core / "opguard" / "__init__.py").resolve(),
        "opguard.rules": (core / "opguard" / "rules.py").resolve(),
    }


def test_core_modules_import_without_lightning() -> None:
    """``import lightning_numguard.X`` runs the package ``__init__`` first: no Lightning there."""
    imports = "\n".join(f"import lightning_numguard.{m}" for m in CORE_MODULES)
    result = _run(
        imports
        + "\nimport sys\n"
        + "print('LEAKED', sorted(m for m in sys.modules if m.partition('.')[0] in BLOCKED))\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LEAKED []" in result.stdout


def test_each_core_module_itself_is_lightning_free() -> None:
    """Each core module on its own, with the package ``__init__`` bypassed (an empty package shell).

    One interpreter (torch is slow to import); the leak check after each import names the module.
    """
    result = _run(
        f"""
        import importlib
        import types

        shell = types.ModuleType("lightning_numguard")
        shell.__path__ = [{str(REPO / "lightning_numguard")!r}]
        sys.modules["lightning_numguard"] = shell
        for name in {sorted(CORE_MODULES)!r}:
            mod = importlib.import_module("lightning_numguard." + name)
            leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
            assert not leaked, (name, leaked)
            print("OK", name, mod.__file__)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _ok_lines(result.stdout) == CORE_MODULES


#: The table tests of the pure decisions: they must run with Lightning unimportable.
PURE_TABLE_TESTS = (
    "decide/test_policy.py",
    "detect/test_flags.py",
    "diagnose/test_findings.py",
    "state/test_quarantine.py",
    "diagnose/test_replay.py",
)


def test_the_decision_tables_run_without_lightning() -> None:
    """The policy, flag, finding, quarantine and replay tables pass in an interpreter that cannot import Lightning."""
    files = [str(REPO / "tests" / name) for name in PURE_TABLE_TESTS]
    result = _run(
        f"""
        import pytest
        code = pytest.main(["-q", "-p", "no:cacheprovider", *{files!r}])
        leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
        print("EXIT", int(code), "LEAKED", leaked)
        """
    )
    assert "EXIT 0 LEAKED []" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout
