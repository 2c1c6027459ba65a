"""The Fabric and plain doors under real DDP: two gloo processes, a fault on one rank, every rank acting together.

One launch (``ddp_script.py``: Fabric starts the second process and the process group) runs five fits in sequence;
each rank reports its own. Every rank must record the same events, naming the rank that saw the fault, and end with
the same finite weights; a halt raises ``NonFiniteError`` on every rank; rank 0 alone writes ``events.jsonl``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.doors.fabric.entry_points import subprocess_env

SCRIPT = Path(__file__).with_name("ddp_script.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ddp_doors")
    env = subprocess_env(out)
    env["MASTER_PORT"] = str(_free_port())
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], cwd=out, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _fit(ranks: tuple[Path, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    out, found = ranks
    fits = [r[name] for r in found]
    assert fits[0]["events"] == fits[1]["events"], name  # every rank has the same record
    for fit in fits:
        assert fit["finite"] and fit["same_as_rank0"], (name, fit)
    lines = (out / name / "events.jsonl").read_text().splitlines()
    written = [(e["kind"], e["where"], e["rank"], e["step"], e["action"]) for e in map(json.loads, lines)]
    assert written == [(e["kind"], e["where"], e["rank"], e["step"], e["action"]) for e in fits[0]["events"]]  # once
    return fits


@pytest.mark.ddp
@pytest.mark.parametrize("door", ["plain", "fabric"])
def test_a_fault_on_rank_1_rolls_every_rank_back_together(ranks: Any, door: str) -> None:
    fits = _fit(ranks, f"{door}_rollback")
    first = fits[0]["events"][0]
    assert (first["kind"], first["where"], first["rank"], first["step"]) == ("nonfinite_input", ["batch['x']"], 1, 2)
    for fit in fits:
        assert fit["counters"]["rollbacks"] == 1 and fit["raised"] is None


@pytest.mark.ddp
@pytest.mark.parametrize("door", ["plain", "fabric"])
def test_a_halt_on_rank_0_raises_on_every_rank(ranks: Any, door: str) -> None:
    fits = _fit(ranks, f"{door}_halt")
    first = fits[0]["events"][0]
    assert (first["kind"], first["rank"], first["step"], first["action"]) == ("nonfinite_loss", 0, 2, "halt")
    for fit in fits:
        assert fit["raised"] is not None and fit["raised"].startswith("NonFiniteError: NumGuard halted"), fit
    assert (ranks[0] / f"{door}_halt" / "last_finite.ckpt").is_file()


@pytest.mark.ddp
def test_accumulation_under_fabric_ddp_names_the_bad_micro_batch(ranks: Any) -> None:
    fits = _fit(ranks, "fabric_accumulate")
    first = fits[0]["events"][0]
    assert (first["kind"], first["rank"], first["step"], first["batch_idx"]) == ("nonfinite_input", 0, 1, 3)
    assert {e["step"] for e in fits[0]["events"]} == {1}
