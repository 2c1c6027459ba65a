"""Reproducible or not, across ranks (issue 33): real DDP on 2 and 4 gloo processes, a fault of one rank's device,
transient or persistent, and a fault of the data, told apart online by a neighbour rank re-running the bad rank's
micro-batch. Three fits per world size (``trust_ddp_script.py``), in the one launch of that world size (``launches.py``)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import pytest

from tests.doors.trainer.launches import Launch

HOST = socket.gethostname()


def _fits(launched: Callable[[int], Launch], world: int, fault_rank: int) -> dict[str, list[dict[str, Any]]]:
    """Every rank's result of the three fits of ``world`` ranks (``trust_ddp_script.py`` in that world's launch, whose
    faulty rank is the last: ``launches.py``)."""
    assert fault_rank == world - 1
    run = launched(world)
    root = run.folder("trust_ddp_script")
    out = {}
    for mode in ("transient", "persistent", "data"):
        paths = [root / mode / f"rank{r}.json" for r in range(world)]
        assert all(p.exists() for p in paths), f"{mode} wrote no result\n{run.output()}"
        out[mode] = [json.loads(p.read_text()) for p in paths]
    return out


def _root(events: list[dict[str, Any]], step: int) -> dict[str, Any]:
    return next(e for e in events if e["step"] == step and e.get("root_cause", True))


@pytest.mark.ddp
@pytest.mark.parametrize(("world", "fault_rank"), [(2, 1), (4, 3)], ids=["2-ranks", "4-ranks"])
def test_a_neighbour_rank_tells_a_faulty_device_from_bad_data(launched: Any, world: int, fault_rank: int) -> None:
    fits = _fits(launched, world, fault_rank)
    neighbour = (fault_rank + 1) % world
    device = {"rank": fault_rank, "host": HOST, "device": "cpu"}
    for ranks in fits.values():  # every rank has the same record
        assert all(r["events"] == ranks[0]["events"] for r in ranks)

    # transient: the bad rank's own replay is finite; no neighbour is asked
    transient = fits["transient"][0]
    event = _root(transient["events"], 2)
    assert (event["kind"], event["rank"], event["where"]) == ("nonfinite_output", fault_rank, ["net.2"])
    assert event["details"]["reproduced"] is False and "neighbour" not in event["details"]
    assert event["details"]["device_fault"] == {"verdict": "transient", **device}
    assert f"a transient fault of the device — rank {fault_rank}, host {HOST}, device cpu" in event["message"]
    assert transient["raised"] is None and transient["device_faults"] == {str(fault_rank): {**_where(), "transient": 1}}
    assert any(
        f"device faults on rank {fault_rank} (host {HOST}, device cpu): 1 transient" in s for s in transient["summary"]
    )

    # persistent on one rank: its replay is bad again, the neighbour's re-run of its micro-batch is finite
    persistent = fits["persistent"]
    for step in (2, 3, 4):
        event = _root(persistent[0]["events"], step)
        assert event["details"]["reproduced"] is True
        assert event["details"]["neighbour"] == {"rank": neighbour, "reproduced": False}
        assert event["details"]["device_fault"] == {"verdict": "this_rank", **device}
        assert f"not when rank {neighbour} re-ran the same micro-batch" in event["message"]
        assert "a fault of this rank's device" in event["message"]
    assert [_root(persistent[0]["events"], s)["action"] for s in (2, 3, 4)] == ["rollback", "rollback", "halt"]
    for r in persistent:  # every rank halts together, with the error a scheduler can act on
        raised = r["raised"]
        assert raised["type"] == "SuspectedHardwareError"
        assert (raised["rank"], raised["host"], raised["device"], raised["faults"]) == (fault_rank, HOST, "cpu", 3)
        assert f"3 device faults on rank {fault_rank} (host {HOST}, device cpu" in raised["message"]
        assert r["device_faults"] == {str(fault_rank): {**_where(), "this_rank": 3}}

    # the data: both the bad rank and its neighbour make it again; no device is blamed
    data = fits["data"][0]
    event = _root(data["events"], 2)
    assert (event["kind"], event["rank"]) == ("nonfinite_loss", fault_rank)
    assert event["details"]["reproduced"] is True
    assert event["details"]["neighbour"] == {"rank": neighbour, "reproduced": True}
    assert "device_fault" not in event["details"]
    assert (
        f"rank {neighbour} re-ran the same micro-batch with the same weights and RNG and made it too"
        in event["message"]
    )
    assert event["op"] == "log" and data["raised"] is None and data["device_faults"] == {}


def _where() -> dict[str, str]:
    return {"host": HOST, "device": "cpu"}
