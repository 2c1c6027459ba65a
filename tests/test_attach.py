"""Zero-code attach through Lightning's and Fabric's ``*.callbacks_factory`` entry points, opt-in from the environment.

How the entry points are found. Lightning reads them from installed package metadata
(``importlib.metadata.entry_points(group=...)``) each time a ``Trainer`` is built. Once this package is
installed from its current ``pyproject.toml`` (``pip install -e .``), its own metadata registers both
factories and the tests use it as it is. When the installed metadata is older (an editable install made
before the entry points were added, or one shared with another checkout), the subprocess gets a minimal
``numguard_attach_test-0.dist-info`` (``METADATA`` + ``entry_points.txt`` naming the same two factories) in
a temporary folder on its ``PYTHONPATH``, which ``importlib.metadata`` discovers like any installed
distribution. Either way, the code under test is this checkout's ``lightning_numguard.doors.trainer.attach``, and the
registration in the built wheel is asserted by ``tests/test_metadata.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from lightning_numguard.doors.trainer import attach as _attach
from lightning_numguard.errors import NumGuardConfigError

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {
    "pytorch_lightning.callbacks_factory": "lightning_numguard.doors.trainer.attach:pytorch_lightning_callbacks",
    "lightning.pytorch.callbacks_factory": "lightning_numguard.doors.trainer.attach:lightning_callbacks",
    "lightning.fabric.callbacks_factory": "lightning_numguard.doors.fabric.attach:fabric_callbacks",
    "lightning_fabric.callbacks_factory": "lightning_numguard.doors.fabric.attach:fabric_callbacks",
}

# Run in a fresh interpreter: several Trainers and Fabrics, the environment changed between them (the factories read
# it each time one is built); prints one JSON line per scenario. The Fabric of each run is the package's own:
# ``lightning.fabric`` beside ``lightning.pytorch``, the standalone ``lightning_fabric`` beside ``pytorch_lightning``.
SCRIPT = r"""
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
from torch.utils.data import DataLoader, TensorDataset
pkg = sys.argv[1]
if pkg == "lightning":
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from lightning_numguard.lightning import NumGuardCallback
else:
    import pytorch_lightning as pl
    from lightning_fabric import Fabric
    from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardConfigError
from lightning_numguard.fabric import NumGuard
from tests.helpers import quiet_trainer

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        loss = self.lin(batch[0]).pow(2).mean()
        return loss + float("nan") if self.global_step == 2 else loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def build(env, callbacks=()):
    for k in ("NUMGUARD", "NUMGUARD_CONFIG"):
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        tr = quiet_trainer(list(callbacks), pl.Trainer, max_steps=4, default_root_dir=sys.argv[2])
    except NumGuardConfigError as err:
        return None, {"error": str(err)}
    guards = [c for c in tr.callbacks if isinstance(c, NumGuardCallback)]
    return tr, {"guards": [(type(g).__module__, g.action) for g in guards]}

def build_fabric(env, callbacks=()):
    for k in ("NUMGUARD", "NUMGUARD_CONFIG"):
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        fabric = Fabric(accelerator="cpu", devices=1, callbacks=list(callbacks))
    except NumGuardConfigError as err:
        return {"error": str(err)}
    return {"guards": [g.action for g in fabric._callbacks if isinstance(g, NumGuard)]}

out = {}
for name, env in json.loads(sys.argv[3]).items():
    tr, out[name] = build(env)
    out["fabric:" + name] = build_fabric(env)
out["fabric:user_guard_kept"] = build_fabric({"NUMGUARD": "1"}, [NumGuard(action="warn")])
tr, out["user_guard_kept"] = build({"NUMGUARD": "1"}, [NumGuardCallback(action="warn")])
tr, out["fit"] = build({"NUMGUARD": "1"})
tr.fit(M(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
(guard,) = [c for c in tr.callbacks if isinstance(c, NumGuardCallback)]
out["fit"]["events"] = [(e["kind"], e["step"], e["action"]) for e in guard.events]
print(json.dumps(out))
"""


def _missing_groups() -> dict[str, str]:
    """The groups whose factory the installed metadata does not register (registered twice, a factory would run
    twice)."""
    return {g: v for g, v in GROUPS.items() if not any(ep.value == v for ep in entry_points(group=g))}


def _entry_point_dir(tmp_path: Path, groups: dict[str, str]) -> Path:
    dist = tmp_path / "ep" / "numguard_attach_test-0.dist-info"
    dist.mkdir(parents=True)
    dist.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: numguard-attach-test\nVersion: 0\n")
    dist.joinpath("entry_points.txt").write_text(
        "".join(f"[{group}]\nnumguard = {value}\n\n" for group, value in groups.items())
    )
    return dist.parent


def _run(tmp_path: Path, package: str, scenarios: dict[str, dict[str, str]]) -> dict[str, dict]:
    missing = _missing_groups()
    path = [str(ROOT)] + ([str(_entry_point_dir(tmp_path, missing))] if missing else [])
    env = {k: v for k, v in os.environ.items() if k not in ("NUMGUARD", "NUMGUARD_CONFIG")}
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, package, str(tmp_path), json.dumps(scenarios)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_attach_under_pytorch_lightning(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("action: explode\n")
    scenarios = {
        "off": {},
        "on": {"NUMGUARD": "1"},
        "off_wins": {"NUMGUARD": "0", "NUMGUARD_CONFIG": str(bad)},
        "bad_config": {"NUMGUARD_CONFIG": str(bad)},
    }
    out = _run(tmp_path, "pytorch_lightning", scenarios)
    module = "lightning_numguard.doors.trainer.callback"
    assert out["off"] == {"guards": []}
    assert out["on"] == {"guards": [[module, "rollback"]]}
    assert out["off_wins"] == {"guards": []}
    assert str(bad) in out["bad_config"]["error"] and "'explode'" in out["bad_config"]["error"]
    assert out["user_guard_kept"] == {"guards": [[module, "warn"]]}  # no second guard
    assert out["fit"]["guards"] == [[module, "rollback"]]
    assert out["fit"]["events"] == [["nonfinite_loss", 2, "rollback"]]
    # the standalone lightning_fabric's Fabric, from its own entry-point group
    assert out["fabric:off"] == {"guards": []} and out["fabric:off_wins"] == {"guards": []}
    assert out["fabric:on"] == {"guards": ["rollback"]}
    assert str(bad) in out["fabric:bad_config"]["error"] and "'explode'" in out["fabric:bad_config"]["error"]
    assert out["fabric:user_guard_kept"] == {"guards": ["warn"]}


def test_attach_under_lightning_from_a_config_file(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch", reason="the `lightning` package is in the dev extra")
    cfg = tmp_path / "numguard.yaml"
    cfg.write_text("class_path: lightning_numguard.lightning.NumGuardCallback\ninit_args:\n  action: skip\n")
    out = _run(tmp_path, "lightning", {"off": {}, "config": {"NUMGUARD_CONFIG": str(cfg)}})
    module = "lightning_numguard.lightning"
    assert out["off"] == {"guards": []}
    assert out["config"] == {"guards": [[module, "skip"]]}
    assert out["user_guard_kept"] == {"guards": [[module, "warn"]]}
    assert out["fit"]["events"] == [["nonfinite_loss", 2, "rollback"]]
    # lightning.fabric's Fabric (LitGPT's), from its own group: the same YAML file (a LightningCLI entry) configures it
    assert out["fabric:off"] == {"guards": []}
    assert out["fabric:config"] == {"guards": ["skip"]}
    assert out["fabric:user_guard_kept"] == {"guards": ["warn"]}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"NUMGUARD": "1"}, {}),
        ({"NUMGUARD": "True"}, {}),
        ({"NUMGUARD": "on"}, {}),
        ({"NUMGUARD": "0"}, None),
        ({"NUMGUARD": ""}, None),
        ({"NUMGUARD": "off"}, None),
    ],
)
def test_requested_init_args_from_the_flag(env: dict[str, str], expected: dict | None) -> None:
    assert _attach.requested_init_args(env) == expected


def test_requested_init_args_from_a_file(tmp_path: Path) -> None:
    cfg = tmp_path / "g.yaml"
    cfg.write_text("action: halt\nmax_abs_input: 1.0e6\ncheck: [inputs, loss]\n")
    expected = {"action": "halt", "max_abs_input": 1e6, "check": ["inputs", "loss"]}
    assert _attach.requested_init_args({"NUMGUARD_CONFIG": str(cfg)}) == expected
    assert _attach.requested_init_args({"NUMGUARD": "1", "NUMGUARD_CONFIG": str(cfg)}) == expected
    cfg.write_text("")
    assert _attach.requested_init_args({"NUMGUARD_CONFIG": str(cfg)}) == {}


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, r"NUMGUARD_CONFIG='.*missing\.yaml' cannot be read"),
        ("action: [unclosed\n", r"NUMGUARD_CONFIG='.*missing\.yaml' is not valid YAML"),
        ("- rollback\n", r"NUMGUARD_CONFIG='.*missing\.yaml' must hold a mapping of NumGuardCallback init args.*list"),
    ],
)
def test_a_bad_config_file_is_named(tmp_path: Path, content: str | None, match: str) -> None:
    cfg = tmp_path / "missing.yaml"
    if content is not None:
        cfg.write_text(content)
    with pytest.raises(NumGuardConfigError, match=match):
        _attach.requested_init_args({"NUMGUARD_CONFIG": str(cfg)})


def test_a_bad_flag_value_is_named() -> None:
    with pytest.raises(NumGuardConfigError, match=r"NUMGUARD='maybe' is not understood; allowed: '1'"):
        _attach.requested_init_args({"NUMGUARD": "maybe"})


def test_an_unknown_or_invalid_argument_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "g.yaml"
    monkeypatch.delenv("NUMGUARD", raising=False)
    monkeypatch.setenv("NUMGUARD_CONFIG", str(cfg))
    cfg.write_text("acton: skip\n")
    with pytest.raises(NumGuardConfigError, match=r"g\.yaml' names an argument NumGuardCallback does not take.*acton"):
        _attach.pytorch_lightning_callbacks()
    cfg.write_text("snapshot_every_n_steps: 0\n")
    with pytest.raises(NumGuardConfigError, match=r"snapshot_every_n_steps.*\(from NUMGUARD_CONFIG='.*g\.yaml'\)"):
        _attach.pytorch_lightning_callbacks()


def test_nothing_requested_nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NUMGUARD", raising=False)
    monkeypatch.delenv("NUMGUARD_CONFIG", raising=False)
    assert _attach.pytorch_lightning_callbacks() == []
