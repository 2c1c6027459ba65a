"""``lightning_numguard.core`` needs only torch and the standard library: it imports with Lightning blocked.

Each check runs in a fresh interpreter whose ``sys.meta_path`` refuses every Lightning
distribution (``pytorch_lightning``, ``lightning``, ``lightning_fabric``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE_MODULES = ("tree", "checks", "watch", "snapshot", "coverage", "events", "opguard")
BLOCKED = ("pytorch_lightning", "lightning", "lightning_fabric")

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


def test_core_modules_import_without_lightning() -> None:
    """``import lightning_numguard.core.X`` runs the package ``__init__`` first: no Lightning there."""
    imports = "\n".join(f"import lightning_numguard.core.{m}" for m in CORE_MODULES)
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
        for name in {CORE_MODULES!r}:
            mod = importlib.import_module("lightning_numguard.core." + name)
            leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
            assert not leaked, (name, leaked)
            print("OK", mod.__file__)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for module in CORE_MODULES:
        assert f"OK {REPO / 'lightning_numguard' / 'core' / module}.py" in result.stdout, module
