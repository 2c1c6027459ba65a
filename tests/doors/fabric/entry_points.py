"""Fabric's callback entry points for a subprocess, whatever this checkout's installed metadata says.

Fabric reads its ``*.callbacks_factory`` groups from installed package metadata each time a ``Fabric`` is built. Once
this package is installed from its current ``pyproject.toml`` its own metadata registers the factory; an older
editable install (one made before the Fabric door existed, or one shared with another checkout) does not, and then
the subprocess gets a minimal ``numguard_fabric_test-0.dist-info`` naming the same factory on its ``PYTHONPATH``, as
``tests/test_attach.py`` does for the Trainer's groups. Either way the code under test is this checkout's
``lightning_numguard.doors.fabric.attach``; ``tests/test_metadata.py`` asserts the registration of the built wheel.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FACTORY = "lightning_numguard.doors.fabric.attach:fabric_callbacks"
GROUPS = ("lightning.fabric.callbacks_factory", "lightning_fabric.callbacks_factory")


def missing() -> list[str]:
    """The groups whose factory the installed metadata does not register (registered twice, it would run twice)."""
    return [g for g in GROUPS if not any(ep.value == FACTORY for ep in entry_points(group=g))]


def subprocess_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a subprocess that builds a ``Fabric``: this checkout first on ``PYTHONPATH``, the entry
    points registered, the guard's variables unset, one CPU thread."""
    path = [str(ROOT)]
    groups = missing()
    if groups:
        dist = tmp_path / "ep" / "numguard_fabric_test-0.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        dist.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: numguard-fabric-test\nVersion: 0\n")
        dist.joinpath("entry_points.txt").write_text("".join(f"[{g}]\nnumguard = {FACTORY}\n\n" for g in groups))
        path.append(str(dist.parent))
    env = {k: v for k, v in os.environ.items() if k not in ("NUMGUARD", "NUMGUARD_CONFIG")}
    env = {k: v for k, v in env.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return env
