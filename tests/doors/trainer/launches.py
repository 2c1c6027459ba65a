"""The multi-process Trainer tests' launches: every fit of one world size in one process group.

Starting a launch costs more than most of its fits (each process imports torch and Lightning, about 8 s on the 2-core
machine), so ``test_ddp.py``, ``test_trust_ddp.py``, ``test_sharded.py`` and ``test_sharded_lib.py`` share one
launch of ``pack_script.py`` per world size (2 and 4), run once per session (the ``launched`` fixture of this
folder's ``conftest.py``). Each script's fits go into ``ROOT/<script>/``; each test module says what its fits are
(its constants, read here when the launch starts). A launch that fails fails the tests of every fit that wrote
nothing, each with the launch's output.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).with_name("pack_script.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def entries(world: int) -> list[tuple[str, str]]:
    """``(script, arguments)`` of every fit of ``world`` ranks, in order: the DDP pack last (its last fit halts)."""
    from tests.doors.trainer import test_ddp, test_sharded, test_sharded_lib

    def runs(scenarios: dict[str, str | list[str]], worlds: dict[str, int]) -> str:
        picked = [(layout, s) for layout, w in worlds.items() if w == world for s in _names(scenarios[layout])]
        return ",".join(f"{layout}/{s}" for layout, s in picked)

    out = [
        ("sharded_script", runs(test_sharded.SCENARIOS, test_sharded.WORLD)),
        ("sharded_lib_script", runs(test_sharded_lib.SCENARIOS, test_sharded_lib.WORLD)),
        ("trust_ddp_script", f"{world} {world - 1}"),
    ]
    if world == 2:
        out.append(("ddp_script", "--pack " + " ".join(f"{name}={spec}" for name, spec in test_ddp.PACK.items())))
    return out


def _names(scenarios: str | list[str]) -> list[str]:
    return scenarios.split(",") if isinstance(scenarios, str) else list(scenarios)


@dataclass
class Launch:
    """One launch: its root folder and what the process said."""

    root: Path
    proc: subprocess.CompletedProcess[str]

    def output(self) -> str:
        return f"exit {self.proc.returncode}\n{self.proc.stdout[-2000:]}\n{self.proc.stderr[-4000:]}"

    def folder(self, script: str) -> Path:
        return self.root / script


def launch(root: Path, world: int) -> Launch:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env["MASTER_PORT"] = str(free_port())  # a fixed port can still be in TIME_WAIT from an earlier launch
    args = [a for script, arguments in entries(world) for a in (script, arguments)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(root), *args], cwd=root, env=env, capture_output=True, text=True, timeout=1200
    )
    return Launch(root, proc)
