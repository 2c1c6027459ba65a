"""Zero-code attach through Fabric's callback entry points (``lightning.fabric`` and ``lightning_fabric``).

A fresh interpreter builds ``Fabric`` objects of both packages under several environments (the factory reads it
each time) and reports the guards each got; see ``entry_points.py`` for how the entry points are found.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_numguard.doors.fabric import attach as fabric_attach
from lightning_numguard.errors import NumGuardConfigError
from tests.doors.fabric.entry_points import subprocess_env

SCRIPT = r"""
import json, os, sys, warnings
warnings.simplefilter("ignore")
from lightning_numguard.fabric import NumGuard
from lightning_numguard.errors import NumGuardConfigError

def build(package, env, callbacks=()):
    for k in ("NUMGUARD", "NUMGUARD_CONFIG"):
        os.environ.pop(k, None)
    os.environ.update(env)
    if package == "lightning.fabric":
        from lightning.fabric import Fabric
    else:
        from lightning_fabric import Fabric
    try:
        fabric = Fabric(accelerator="cpu", devices=1, callbacks=list(callbacks))
    except NumGuardConfigError as err:
        return {"error": str(err)}
    return {"guards": [(g.action, g.dirpath) for g in fabric._callbacks if isinstance(g, NumGuard)]}

out = {}
for package in ("lightning.fabric", "lightning_fabric"):
    for name, env in json.loads(sys.argv[1]).items():
        out[f"{package}:{name}"] = build(package, env)
    out[f"{package}:user_guard_kept"] = build(package, {"NUMGUARD": "1"}, [NumGuard(action="warn")])
print(json.dumps(out))
"""


def test_every_fabric_gets_the_guard_the_environment_asks_for(tmp_path: Path) -> None:
    good = tmp_path / "numguard.yaml"
    good.write_text(
        f"class_path: lightning_numguard.lightning.NumGuardCallback\ninit_args:\n  action: skip\n  dirpath: {tmp_path}\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("action: explode\n")
    scenarios = {
        "off": {},
        "on": {"NUMGUARD": "1"},
        "config": {"NUMGUARD_CONFIG": str(good)},
        "off_wins": {"NUMGUARD": "0", "NUMGUARD_CONFIG": str(bad)},
        "bad_config": {"NUMGUARD_CONFIG": str(bad)},
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(scenarios)],
        capture_output=True,
        text=True,
        env=subprocess_env(tmp_path),
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for package in ("lightning.fabric", "lightning_fabric"):
        assert out[f"{package}:off"] == {"guards": []}
        assert out[f"{package}:on"] == {"guards": [["rollback", None]]}
        assert out[f"{package}:config"] == {"guards": [["skip", str(tmp_path)]]}
        assert out[f"{package}:off_wins"] == {"guards": []}
        error = out[f"{package}:bad_config"]["error"]
        assert "'explode'" in error and str(bad) in error, error
        assert out[f"{package}:user_guard_kept"] == {"guards": [["warn", None]]}  # no second guard


def test_an_argument_the_fabric_guard_does_not_take_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = tmp_path / "g.yaml"
    monkeypatch.delenv("NUMGUARD", raising=False)
    monkeypatch.setenv("NUMGUARD_CONFIG", str(cfg))
    cfg.write_text("acton: skip\n")
    with pytest.raises(NumGuardConfigError, match=r"g\.yaml' names an argument NumGuard does not take.*acton"):
        fabric_attach.fabric_callbacks()
    cfg.write_text("sync_mode: deferred\n")
    with pytest.raises(
        NumGuardConfigError, match=r"does not apply to a Fabric loop.*\(from NUMGUARD_CONFIG='.*g\.yaml'\)"
    ):
        fabric_attach.fabric_callbacks()
    monkeypatch.delenv("NUMGUARD_CONFIG")
    assert fabric_attach.fabric_callbacks() == []
