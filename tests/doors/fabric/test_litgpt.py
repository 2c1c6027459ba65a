"""LitGPT's real pretraining loop, unchanged, guarded by ``NUMGUARD`` alone (issue 32's done-criterion).

One subprocess runs LitGPT 0.5.13's own ``litgpt.pretrain.setup`` three times on the tiny set-up of
``litgpt_parts.py`` (Fabric, ``torch.compile``, AdamW, the cosine LR it sets each step, ``clip_gradients(max_norm=1.0)``
with ``error_if_nonfinite=True``, 12 iterations on the CPU): without the guard; with ``NUMGUARD_CONFIG`` (clean
data); with ``NUMGUARD=1`` and both faults of the issue (a NaN left in a weight by the optimizer after its 4th
step, a token id past the vocabulary in the 6th batch). Unguarded, each fault kills LitGPT's run (the issue's report:
``clip_gradients`` raises on the non-finite norm, the compiled kernel on the index); ``test_fabric.py`` shows both
deaths on a loop of the same shape, in-process. The compiled kernels are cached after the first run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.doors.fabric.entry_points import subprocess_env

pytest.importorskip("litgpt", reason="LitGPT is a test extra: pip install -r requirements/litgpt.txt")

SCRIPT = Path(__file__).with_name("litgpt_script.py")


def _runs(tmp_path: Path, specs: str) -> dict[str, dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "numguard.yaml").write_text(
        f"action: rollback\ndirpath: {tmp_path / 'from_yaml'}\nsnapshot_every_n_steps: 5\n"
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), specs],
        cwd=tmp_path,
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("litgpt")
    found = _runs(tmp, "clean:0:,config:yaml:,faults:1:nan4+tok5")
    found["dir"] = tmp
    return found


def test_both_faults_are_survived_and_named(runs: dict[str, Any]) -> None:
    run = runs["faults"]
    assert run["raised"] is None, run.get("trace")
    assert run["finite"]
    events = run["events"]
    nan_weight = [e for e in events if e["step"] == 4]
    assert nan_weight[0]["kind"] == "nonfinite_param" and nan_weight[0]["action"] == "rollback", nan_weight
    assert nan_weight[0]["where"] == ["lm_head.weight"], nan_weight  # the optimizer's first parameter
    token = [e for e in events if e["step"] == 5]
    assert [(e["kind"], e["op"], e["module"], e["action"]) for e in token] == [
        ("op_domain", "embedding", "transformer.wte", "rollback")
    ], token
    details = token[0]["details"]
    assert details["rule"] == "index in [0, 128)" and details["min"] == details["max"] == 130.0, details
    assert "130" in token[0]["message"] and "[0, 128)" in token[0]["message"]
    assert {e["step"] for e in events} == {4, 5}  # every other step clean
    # NUMGUARD=1 and no dirpath: the files go to the Fabric logger's log_dir
    (path,) = run["events_files"]
    assert path.endswith("logs/tensorboard/version_0/numguard/events.jsonl"), path
    assert Path(path).with_name("last_finite.ckpt").is_file()


def test_a_guarded_clean_run_is_bitwise_the_unguarded_one(runs: dict[str, Any]) -> None:
    assert runs["config"]["raised"] is None and runs["clean"]["raised"] is None
    assert runs["config"]["events"] == [] and not (runs["dir"] / "from_yaml" / "events.jsonl").exists()
    clean = torch.load(runs["dir"] / "out" / "clean.pt")
    guarded = torch.load(runs["dir"] / "out" / "config.pt")
    assert clean.keys() == guarded.keys() and len(clean) > 5
    assert all(torch.equal(clean[k], guarded[k]) for k in clean)


def test_the_door_adds_no_graph_break_and_no_recompile(runs: dict[str, Any]) -> None:
    """``torch.compile`` keeps working: no graph break, and no recompile of the guard's (the output watch, this door,
    its embedding check); LitGPT's own evaluation graph is the only other one."""
    for name in ("clean", "config", "faults"):
        assert runs[name]["graph_breaks"] == {}, (name, runs[name]["graph_breaks"])
    for name in ("config", "faults"):
        extra = [r for r in runs[name]["recompiles"] if "grad_mode" not in r]  # the evaluation graph: LitGPT's own
        assert extra == [], extra
    assert runs["faults"]["graphs"] == runs["config"]["graphs"]


def test_the_guarded_run_compiles_as_many_graphs_as_the_unguarded_one(runs: dict[str, Any]) -> None:
    assert runs["config"]["graphs"] == runs["clean"]["graphs"]
