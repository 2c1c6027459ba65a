"""Every module of ``benchmarks/`` imports: a command nobody ran since a move (``benchmarks.overhead`` asked
``instruments`` for ``micro``, which stayed in ``benchmarks``; ``benchmarks/gpu.sh`` and
``benchmarks.compare_revisions`` run it) fails here, not on the day a GPU is lent. The tests never import the
benchmarks themselves (``tests/test_instruments.py``): one interpreter of their own imports every module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_benchmark_module_imports() -> None:
    names = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")
    assert "overhead" in names and "host_time" in names
    code = f"import importlib\nfor name in {names!r}:\n    importlib.import_module('benchmarks.' + name)\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
