"""``sync_mode="deferred"`` in a real Trainer: no host read per step, a skip on the device, a late decision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from instruments.syncs import SyncCounter
from lightning_numguard import NonFiniteError, NumGuardCallback
from lightning_numguard.errors import NumGuardConfigError
from tests.helpers import FaultData, FaultModel, SyncWindow, all_finite, guard_warns, loader, trainer


class FusedModel(FaultModel):
    """``FaultModel`` with a fused AdamW (the device-side skip needs ``found_inf`` support)."""

    def __init__(self, *args: Any, fused: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused = fused

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=self.fused)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run(tmp_path: Any, site: str | None, mode: str, **kwargs: Any) -> tuple[NumGuardCallback, FusedModel]:
    torch.manual_seed(0)
    model = FusedModel(site=site, step=3)
    kwargs.setdefault("emit_warnings", False)  # these tests read the events; the warnings are tested in reporting/
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / mode), sync_mode=mode, **kwargs)  # type: ignore[arg-type]
    trainer(tmp_path / mode, [guard], max_steps=8).fit(
        model, loader(FaultData(bad_batch=3 if site else None, site=site or "input"))
    )
    return guard, model


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("metric")}


def test_deferred_mode_reads_nothing_on_the_host_during_the_steps(tmp_path):
    counter = SyncCounter(package="lightning_numguard")

    guard = NumGuardCallback(
        action="rollback", dirpath=str(tmp_path / "ng"), snapshot_every_n_steps=2, sync_mode="deferred"
    )
    t = trainer(tmp_path, [SyncWindow(counter), guard], max_steps=8)
    t.callbacks = [c for c in t.callbacks if c is not guard] + [guard]
    with counter:
        t.fit(FusedModel(), loader(FaultData()))
    assert len(counter.step_total) == 8
    assert counter.caused == 0, counter.sites
    assert guard.events == []


def test_a_nan_batch_is_skipped_on_the_device_and_ends_where_an_immediate_rollback_does(tmp_path):
    immediate_guard, immediate = run(tmp_path, "input", "every_step")
    deferred_guard, deferred = run(tmp_path, "input", "deferred")
    assert all_finite(deferred.state_dict())
    a, b = weights(immediate), weights(deferred)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    opt_a, opt_b = (m.trainer.optimizers[0].state_dict()["state"] for m in (immediate, deferred))
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])  # AdamW moments and step
    event = deferred_guard.events[0]
    assert event["kind"] == "nonfinite_input" and event["where"] == ["batch['x']"]
    # skipped on the device, nothing restored: a skip, not a rollback (issue 20)
    assert event["step"] == 3 and event["details"]["read_at_step"] == 4 and event["action"] == "skip"
    assert {e["step"] for e in deferred_guard.events} == {3}
    assert all(e["details"]["after"] == "nonfinite_input in `batch['x']`" for e in deferred_guard.events[1:])
    assert all(e["action"] == "skip" for e in deferred_guard.events)
    assert immediate_guard.counters["rollbacks"] == 1  # restored the state at the start of step 3
    assert (deferred_guard.counters["rollbacks"], deferred_guard.counters["skipped_steps"]) == (0, 1)


def test_a_poisoned_weight_is_rolled_back_late_to_a_verified_snapshot(tmp_path):
    guard, model = run(tmp_path, "param", "deferred", snapshot_every_n_steps=1)
    assert all_finite(model.state_dict())
    first = guard.events[0]
    assert first["kind"] == "nonfinite_param" and first["step"] == 3 and "body.0.weight" in first["where"]
    # one incident, one rollback: the step in flight when step 3's flags were read (step 4, computed from the
    # damaged state) is skipped on the device with it and is not a second incident when its own flags are read
    assert guard.counters["rollbacks"] == 1 and guard.counters["incidents"] == 1
    assert {e["step"] for e in guard.events} == {3}
    assert guard.counters["skipped_steps"] == 2


def test_deferred_mode_refuses_an_optimizer_that_ignores_found_inf(tmp_path):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), sync_mode="deferred")
    with pytest.raises(NumGuardConfigError, match=r"AdamW ignores unless it is fused: create it with `fused=True`"):
        trainer(tmp_path, [guard], max_steps=2).fit(FusedModel(fused=False), loader(FaultData()))


class ForeachModel(FusedModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)


def test_deferred_mode_refuses_a_foreach_optimizer_as_the_readme_says(tmp_path):
    """A foreach AdamW steps whatever ``found_inf`` says (only fused kernels read it): refused, and the README says
    "fused", not "fused (or foreach)" (issue 27)."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    claim = readme[readme.index('- `sync_mode="deferred"` needs') :].split("\n- ", 1)[0]
    assert "needs a fused optimizer" in claim and "foreach" in claim and "refused" in claim, claim
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), sync_mode="deferred")
    with pytest.raises(NumGuardConfigError, match=r"AdamW ignores unless it is fused"):
        trainer(tmp_path, [guard], max_steps=2).fit(ForeachModel(), loader(FaultData()))


def test_deferred_mode_and_retry_transient_are_refused_together():
    with pytest.raises(NumGuardConfigError, match=r"recovery\.retry_transient"):
        NumGuardCallback(sync_mode="deferred", recovery={"retry_transient": True})
    with pytest.raises(NumGuardConfigError, match="`sync_mode` must be one of"):
        NumGuardCallback(sync_mode="never")  # type: ignore[arg-type]


def test_a_batch_that_fails_twice_is_quarantined_and_then_skipped_on_the_device(tmp_path):
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"), sync_mode="deferred", emit_warnings=False)
    model = FusedModel()
    trainer(tmp_path, [guard], max_epochs=3).fit(model, loader(FaultData(bad_batch=3)))
    assert [(q["epoch"], q["batch_idx"]) for q in guard.quarantined] == [(1, 3)]
    # epochs 0 and 1 skipped on the device (nothing to restore: no rollback), not 2
    assert guard.counters["incidents"] > 0 and guard.counters["rollbacks"] == 0
    assert [e["action"] for e in guard.events if e["root_cause"]] == ["skip", "skip"]
    assert guard.counters["skipped_steps"] == 3  # the third time, quietly
    assert all_finite(model.state_dict())


@pytest.mark.parametrize(
    ("site", "kind", "where"),
    [("output", "nonfinite_output", ["body.1"]), ("op", "op_domain", ["binary_cross_entropy"])],
)
def test_a_late_event_names_the_block_and_the_op_from_the_records_kept_for_its_step(tmp_path, site, kind, where):
    guard, model = run(tmp_path, site, "deferred")
    first = guard.events[0]
    assert (first["kind"], first["where"][: len(where)], first["step"]) == (kind, where, 3)
    assert all_finite(model.state_dict())


def test_a_late_halt_restores_the_verified_snapshot_and_writes_it_as_last_finite(tmp_path):
    """A weight poisoned at step 3, read at step 4 under action="halt": training stops after the step in flight (skipped
    on the device) with the snapshot of step 2 (the last verified) in place, which is also what last_finite.ckpt holds
    (the halt restores once: under DDP with sharded snapshots that is the one gather, test_ddp.py)."""
    torch.manual_seed(0)
    model = FusedModel(site="param", step=3)
    guard = NumGuardCallback(
        action="halt", dirpath=str(tmp_path / "ng"), sync_mode="deferred", snapshot_every_n_steps=2, emit_warnings=False
    )
    t = trainer(tmp_path, [guard], max_steps=8)
    with pytest.raises(NonFiniteError, match="halted training at step 3"):  # read late: the fault's step named
        t.fit(model, loader(FaultData()))
    assert t.global_step == 5 and all_finite(model.state_dict())
    first = guard.events[0]
    assert (first["kind"], first["step"], first["action"]) == ("nonfinite_param", 3, "halt")
    assert first["details"]["read_at_step"] == 4
    assert guard.snapshots.snapshot is not None and guard.snapshots.snapshot.step == 2
    saved = torch.load(tmp_path / "ng" / "last_finite.ckpt", weights_only=False)
    live = weights(model)
    assert all(torch.equal(saved["state_dict"][k], live[k]) for k in live)
    snap = guard.snapshots.snapshot.model
    assert all(torch.equal(snap[k], live[k]) for k in live)


def test_a_nan_gradient_skipped_on_the_device_is_a_skip_not_a_rollback(tmp_path):
    """Before (issue 20): ``rollbacks: 1`` and ``action: "rollback"`` although nothing was restored."""
    guard, model = run(tmp_path, "grad", "deferred")
    assert all_finite(model.state_dict())
    assert guard.events and {e["step"] for e in guard.events} == {3}
    assert {e["action"] for e in guard.events} == {"skip"}
    assert (guard.counters["rollbacks"], guard.counters["skipped_steps"], guard.counters["incidents"]) == (0, 1, 1)


class _WithSentinel(torch.utils.data.Dataset):
    """FaultData with a field holding -inf in every sample (a mask): a convention of the data, not a fault."""

    def __init__(self) -> None:
        self.data = FaultData()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.data[i], "extra": torch.tensor([float("-inf"), 0.0])}


def test_deferred_mode_stops_acting_on_a_field_flagged_step_after_step(tmp_path):
    """Issue 20: the device skips the flagged steps until the field is declared a convention, then trains."""
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), sync_mode="deferred")
    model = FusedModel()
    with guard_warns(r"convention of this data.*without 'inputs'"):  # after the field's first warning
        trainer(tmp_path, [guard], max_steps=8).fit(model, loader(_WithSentinel()))
    declared = [e for e in guard.events if e["details"].get("convention")]
    assert [(e["step"], e["action"], e["where"]) for e in declared] == [(2, "none", ["batch['extra']"])]
    # read one step late: step 3 was already skipped on the device when step 2's flags declared the field
    assert max(e["step"] for e in guard.events) == 3
    assert guard.counters["skipped_steps"] == 4 and guard.counters["rollbacks"] == 0


def test_a_late_rollback_backs_the_lr_off_opens_the_skip_window_and_writes_last_finite(tmp_path):
    """One pipeline: a rollback decided one step late does what any rollback does (issue 18)."""
    final_lr = {}
    for backoff in (1.0, 0.5):
        torch.manual_seed(0)
        model = FusedModel(site="param", step=3)
        guard = NumGuardCallback(
            action="rollback",
            dirpath=str(tmp_path / str(backoff)),
            sync_mode="deferred",
            snapshot_every_n_steps=2,
            lr_backoff=backoff,
            skip_batches_after_rollback=1,
            emit_warnings=False,
        )
        t = trainer(tmp_path / str(backoff), [guard], max_steps=8)
        t.fit(model, loader(FaultData()))
        final_lr[backoff] = t.optimizers[0].param_groups[0]["lr"]
        first = guard.events[0]
        assert (first["kind"], first["step"], first["action"]) == ("nonfinite_param", 3, "rollback")
        assert (tmp_path / str(backoff) / "last_finite.ckpt").exists()
        # step 3 (skipped on the device), step 4 (in flight when step 3 was read), step 5 (the skip window)
        assert (guard.counters["rollbacks"], guard.counters["skipped_steps"]) == (1, 3)
        assert all_finite(model.state_dict())
    assert "lr_after_backoff" in first["details"]
    assert final_lr[0.5] == pytest.approx(final_lr[1.0] / 2)
