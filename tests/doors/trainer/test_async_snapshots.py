"""snapshot_async: snapshots copied from batch start on, promoted only once verified (double buffering)."""

from __future__ import annotations

import pytest
import torch

from lightning_numguard import NumGuardCallback, NumGuardConfigError
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import FaultData, FaultModel, all_finite, loader, trainer


def fit(tmp_path, snapshot_async, site, step=3, max_steps=6, **kw):
    torch.manual_seed(0)
    model = FaultModel(site=site, step=step)
    guard = NumGuardCallback(
        action="rollback",
        snapshot_every_n_steps=1,
        dirpath=str(tmp_path / "ng"),
        **kw,
        snapshot={"asynchronous": snapshot_async},
    )
    t = trainer(tmp_path, [guard], max_steps=max_steps)
    with pytest.warns(NumGuardWarning):
        t.fit(model, loader(FaultData(bad_batch=step, site=site)))
    return guard, model, t


@pytest.mark.parametrize("site", ["param", "input"])
def test_an_asynchronous_run_rolls_back_bitwise_like_a_synchronous_one(tmp_path, site):
    """``param``: the start-of-step state is bad (the candidate is discarded); ``input``: it is verified (promoted)."""
    sync_guard, sync_model, sync_t = fit(tmp_path / "sync", False, site)
    guard, model, t = fit(tmp_path / "async", True, site)
    assert guard.snapshots.async_on and not sync_guard.snapshots.async_on
    assert guard.snapshots.spare is not None  # the asynchronous path ran: it keeps a second buffer
    assert guard.counters["rollbacks"] == sync_guard.counters["rollbacks"] == 1
    assert [e["details"].get("snapshot_step") for e in guard.events] == [
        e["details"].get("snapshot_step") for e in sync_guard.events
    ]
    for key, value in sync_model.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    for p_ref, p_got in zip(sync_model.parameters(), model.parameters()):
        for k, v in sync_t.optimizers[0].state[p_ref].items():
            assert torch.equal(v, t.optimizers[0].state[p_got][k]), k
    assert torch.equal(sync_model.metric.compute(), model.metric.compute())


def test_a_candidate_is_never_promoted_when_the_start_of_step_state_is_bad(tmp_path):
    """A NaN weight at step 3: step 3's candidate is copied, never promoted; the snapshot of step 2 survives."""
    guard, model, _ = fit(tmp_path, True, "param", step=3, max_steps=4)
    recovery = guard.snapshots
    assert recovery.snapshot is not None and recovery.snapshot.step == 2
    assert recovery.pending is None and recovery.spare is not None
    assert recovery.spare.model["body.0.weight"].data_ptr() != recovery.snapshot.model["body.0.weight"].data_ptr()
    assert all_finite(recovery.snapshot.model) and all_finite(recovery.snapshot.optimizers)
    assert torch.equal(model.body[0].weight, recovery.snapshot.model["body.0.weight"])  # rolled back to it
    rollback = [e for e in guard.events if e["action"] == "rollback"]
    assert rollback and rollback[0]["step"] == 3


def test_the_snapshots_are_shown_through_a_read_only_view(tmp_path):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), snapshot_every_n_steps=1)
    trainer(tmp_path, [guard], max_steps=2).fit(FaultModel(), loader(FaultData()))
    view = guard.snapshots
    assert view.snapshot is not None and view.snapshot.step == 1 and view.late.candidates == ()
    for name in ("restore", "take", "promote", "candidate"):
        assert not hasattr(view, name), name
    with pytest.raises(AttributeError, match="read-only"):
        view.snapshot = None  # type: ignore[misc]
    assert guard.snapshot_step == 1  # nothing was changed through the view


def test_snapshot_async_is_validated_and_off_by_default_on_the_cpu(tmp_path):
    with pytest.raises(NumGuardConfigError, match=r"snapshot\.asynchronous"):
        NumGuardCallback(snapshot={"asynchronous": "yes"})  # type: ignore[arg-type]
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), snapshot_every_n_steps=1)
    trainer(tmp_path, [guard], max_steps=2).fit(FaultModel(), loader(FaultData()))
    assert not guard.snapshots.async_on and guard.snapshots.spare is None
