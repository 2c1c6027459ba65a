"""One engine, three doors: the same fault gives the same events through the Trainer, a Fabric loop and a plain loop.

Each fault of ``table_model.FAULTS`` is run through a real ``Trainer`` (``NumGuardCallback``), a real ``Fabric``
(``NumGuard``) and a plain loop (``attach``), with the same model code, data, seed and arguments; their events must
agree on kind, where, op, source line and action, and each door's first event must be the fault's root cause.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_numguard import NumGuardCallback, attach
from lightning_numguard.fabric import NumGuard
from tests.doors import table_model as tm
from tests.helpers import trainer

#: the root cause each fault must be named as (kind, where, op)
ROOT = {
    "input": ("nonfinite_input", ("batch['x']",), None),
    "output": ("nonfinite_output", ("mid",), "log"),
    "param": ("nonfinite_param", ("head.weight",), None),
    "op": ("op_domain", ("binary_cross_entropy",), "binary_cross_entropy"),
    "std": ("nonfinite_output", ("norm",), "div"),
    "sqrt": ("nonfinite_grad", None, "SqrtBackward0"),
}

ARGS: dict[str, Any] = {"action": "rollback", "emit_warnings": False}


def _trainer_door(fault: str, tmp_path: Path) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    guard = NumGuardCallback(dirpath=str(tmp_path / "trainer"), **ARGS)
    trainer(tmp_path, [guard], max_steps=tm.STEPS, enable_checkpointing=False, logger=False).fit(
        tm.TableModel(fault), tm.loader(fault)
    )
    return guard.events


def _fabric_door(fault: str, tmp_path: Path) -> list[dict[str, Any]]:
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    guard = NumGuard(dirpath=str(tmp_path / "fabric"), **ARGS)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    model = tm.TableModel(fault)
    model, optimizer = fabric.setup(model, tm.make_optimizer(model, fault))
    for batch in tm.loader(fault):
        loss = model(**batch)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=10.0)  # error_if_nonfinite=True: the guard decides first
        optimizer.step()
        optimizer.zero_grad()
    guard.close()
    return guard.events


def _plain_door(fault: str, tmp_path: Path) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = tm.TableModel(fault)
    optimizer = tm.make_optimizer(model, fault)
    with attach(model, optimizer, dirpath=str(tmp_path / "plain"), **ARGS) as guard:
        for batch in tm.loader(fault):
            loss = model(**batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return guard.events


@pytest.mark.parametrize("fault", tm.FAULTS)
def test_the_same_fault_gives_the_same_events_through_every_door(fault: str, tmp_path: Path) -> None:
    doors = {
        "trainer": _trainer_door(fault, tmp_path),
        "fabric": _fabric_door(fault, tmp_path),
        "plain": _plain_door(fault, tmp_path),
    }
    rows = {door: tm.event_rows(events) for door, events in doors.items()}
    assert rows["fabric"] == rows["trainer"], rows
    assert rows["plain"] == rows["trainer"], rows
    kind, where, op = ROOT[fault]
    for door, events in doors.items():
        first = events[0]
        assert (first["kind"], first["step"], first["action"]) == (kind, 2, "rollback"), (door, first)
        assert where is None or tuple(first["where"]) == where, (door, first)
        assert op is None or first.get("op") == op, (door, first)
        assert all(e["step"] == 2 for e in events), (door, events)  # one bad step, recovered
        assert (tmp_path / door / "events.jsonl").is_file()


@pytest.mark.parametrize("door", ["fabric", "plain"])
def test_a_clean_step_costs_one_host_read_through_the_torch_doors(door: str, tmp_path: Path) -> None:
    """The doors add no host read of their own: a clean step is the engine's one packed read, nothing more (the
    first step also verifies the fit's first snapshot)."""
    from instruments.syncs import SyncCounter

    torch.manual_seed(0)
    model = tm.TableModel("none")
    optimizer = tm.make_optimizer(model, "none")
    fabric = None
    if door == "fabric":
        from lightning.fabric import Fabric

        guard: Any = NumGuard(dirpath=str(tmp_path), **ARGS)
        fabric = Fabric(accelerator="cpu", devices=1, callbacks=[guard])
        model, optimizer = fabric.setup(model, optimizer)
    else:
        guard = attach(model, optimizer, dirpath=str(tmp_path), **ARGS)
    with SyncCounter(copies_from_cpu=True) as counter:
        for batch in tm.loader("none"):
            with counter.step():
                loss = model(**batch)
                fabric.backward(loss) if fabric is not None else loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    guard.close()
    assert guard.events == []
    assert counter.step_caused[1:] == [1] * (tm.STEPS - 1), dict(counter.sites)
