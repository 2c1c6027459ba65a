"""Rollback to the last verified-finite state, and the policy around it."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins import MixedPrecision

from lightning_numguard import NonFiniteError, NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import (
    SITE_CULPRIT,
    SITE_WARNING,
    SITES,
    FaultData,
    FaultModel,
    all_finite,
    guard_warning,
    guard_warns,
    loader,
    trainer,
)


def run(tmp_path, data, model=None, guard=None, **kw):
    model = model or FaultModel()
    callbacks = [guard] if guard is not None else []
    t = trainer(tmp_path, callbacks, **kw)
    torch.manual_seed(0)
    t.fit(model, loader(data))
    return model, t


@pytest.mark.parametrize("bad_batch", [0, 3, 7])
def test_rollback_is_bitwise_identical_to_omitting_the_batch(tmp_path, bad_batch):
    """BatchNorm, AdamW with weight decay, a per-step StepLR and a torchmetrics metric."""
    torch.manual_seed(0)
    init = FaultModel().state_dict()

    ref = FaultModel()
    ref.load_state_dict(init)
    run(tmp_path / "ref", FaultData(omit_batch=bad_batch), ref)

    guarded = FaultModel()
    guarded.load_state_dict(init)
    guard = NumGuardCallback(action="rollback", snapshot_every_n_steps=1, dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match=guard_warning("batch['x']", bad_batch)):
        _, t = run(tmp_path / "ng", FaultData(bad_batch=bad_batch, site="input"), guarded, guard)
    assert guard.counters["rollbacks"] == 1
    ref_sd, got_sd = ref.state_dict(), guarded.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for key in ref_sd:
        assert torch.equal(ref_sd[key], got_sd[key]), key
    ref_opt, got_opt = ref.trainer.optimizers[0], t.optimizers[0]
    assert ref_opt.param_groups[0]["lr"] == got_opt.param_groups[0]["lr"]  # the scheduler was rolled back too
    for p_ref, p_got in zip(ref.parameters(), guarded.parameters()):
        for k, v in ref_opt.state[p_ref].items():
            assert torch.equal(v, got_opt.state[p_got][k]), k
    # the metric did not keep the discarded batch
    assert torch.equal(ref.metric.compute(), guarded.metric.compute())


@pytest.mark.parametrize("site", SITES)
def test_rollback_survives_a_fault_at_every_site(tmp_path, site):
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1, save_last=True)
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    with guard_warns(guard_warning(SITE_WARNING[site])):
        model, t = _fit_with(tmp_path, site, guard, saver)
    assert any(SITE_CULPRIT[site] in e["message"] for e in guard.events), [e["message"] for e in guard.events]
    assert t.global_step == 8
    assert all_finite(model.state_dict())
    assert all_finite(t.optimizers[0].state_dict())
    files = glob.glob(os.path.join(tmp_path, "**", "*.ckpt"), recursive=True)
    assert len(files) >= 8
    for f in files:
        ckpt = torch.load(f, weights_only=False)
        assert all_finite(ckpt["state_dict"]) and all_finite(ckpt["optimizer_states"]), f
    assert guard.counters["rollbacks"] >= 1
    assert any(e["action"] == "rollback" for e in guard.events)
    last = torch.load(tmp_path / "ng" / "last_finite.ckpt", weights_only=False)
    assert all_finite(last["state_dict"])


def _fit_with(tmp_path, site, guard, saver):
    model = FaultModel(site=site, step=3)
    t = trainer(tmp_path, [guard, saver], max_steps=8, enable_checkpointing=True)
    t.fit(model, loader(FaultData(bad_batch=3, site=site)))
    return model, t


def test_lr_backoff_and_skip_window(tmp_path):
    lrs, snapshot_steps = [], []

    class Record(FaultModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            snapshot_steps.append(guard.snapshots.snapshot.step)

    guard = NumGuardCallback(
        action="rollback", lr_backoff=0.5, skip_batches_after_rollback=2, dirpath=str(tmp_path / "ng")
    )
    with pytest.warns(NumGuardWarning, match=guard_warning("batch['x']", 2)):
        run(tmp_path, FaultData(bad_batch=2, site="input"), Record(), guard)
    assert guard.counters["rollbacks"] == 1
    assert guard.counters["skipped_steps"] == 3  # the bad batch and a window of 2
    # StepLR(gamma=0.95) per step; batch 2 rolled back (lr unchanged) and halved; batches 3, 4 skipped
    expected = [1e-2 * 0.95, 1e-2 * 0.95**2, 1e-2 * 0.95**2 * 0.5, 1e-2 * 0.95**2 * 0.5, 1e-2 * 0.95**2 * 0.5]
    assert lrs[:5] == pytest.approx(expected)
    assert lrs[5] == pytest.approx(1e-2 * 0.95**3 * 0.5)
    assert guard.events[0]["details"]["lr_after_backoff"] == pytest.approx([1e-2 * 0.95**2 * 0.5])
    # each batch of the window is skipped from a verified-finite state, which becomes the snapshot
    assert snapshot_steps[2:5] == [2, 3, 4], snapshot_steps


def test_max_rollbacks_escalates_to_halt(tmp_path):
    class EveryStep(FaultModel):
        def _armed(self):
            return self.global_step >= 2

    guard = NumGuardCallback(action="rollback", max_rollbacks=2, dirpath=str(tmp_path / "ng"))
    model = EveryStep(site="loss")
    t = trainer(tmp_path, [guard])
    with (
        pytest.warns(NumGuardWarning, match=guard_warning("the loss is non-finite", 2)),
        pytest.raises(NonFiniteError, match=r"escalated from 'rollback': max_rollbacks reached \(2 rollbacks"),
    ):
        t.fit(model, loader(FaultData()))
    assert guard.counters["rollbacks"] == 2
    assert guard.events[-1]["action"] == "halt"
    assert t.global_step == 5  # the halting step (4) ran, its update discarded
    assert (tmp_path / "ng" / "last_finite.ckpt").exists()
    assert all_finite(model.state_dict())


def test_persistent_batch_is_quarantined_saved_and_skipped_in_later_epochs(tmp_path):
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match=guard_warning("batch['x']", 5)):
        _, t = run(tmp_path, FaultData(bad_batch=5, site="input"), guard=guard, max_epochs=3)
    incidents_at_5 = [e for e in guard.events if e["batch_idx"] == 5 and e["kind"] == "nonfinite_input"]
    assert [e["epoch"] for e in incidents_at_5] == [0, 1]  # third epoch: skipped without incident
    (q,) = guard.quarantined
    assert q["batch_idx"] == 5 and q["epoch"] == 1
    assert q["sample_indices"] == list(range(40, 48))
    saved = torch.load(q["file"], weights_only=True)
    assert saved["batch_idx"] == 5 and torch.isnan(saved["batch"]["x"]).any()
    assert guard.counters["skipped_steps"] == 3
    assert guard.state_dict()["quarantined"][0]["batch_idx"] == 5


def test_retry_tells_transient_from_persistent(tmp_path):
    # transient: the fault fires once; the re-run of the same batch is finite (it is not trained on)
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "a"), recovery={"retry_transient": True})
    # transient: the replay finds `body.1` finite again, so the warning names no particular place
    with pytest.warns(NumGuardWarning, match=guard_warning("", 3)):
        model, _ = run(tmp_path / "a", FaultData(), FaultModel(site="output", step=3, once=True), guard)
    assert guard.events[0]["details"]["retry"] == "transient: finite on retry"
    assert guard.quarantined == []
    assert all_finite(model.state_dict())
    # persistent: the batch itself is bad, so the re-run fails too and it is quarantined at once
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "b"), recovery={"retry_transient": True})
    with pytest.warns(NumGuardWarning, match=guard_warning("batch['x']", 3)):
        run(tmp_path / "b", FaultData(bad_batch=3, site="input"), guard=guard)
    assert guard.events[0]["details"]["retry"] == "persistent: non-finite again"
    assert [q["batch_idx"] for q in guard.quarantined] == [3]
    assert os.path.exists(guard.quarantined[0]["file"])


# Lightning's remark on any mid-epoch resume (what this test does on purpose), not the guard's
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resume_keeps_the_quarantine(tmp_path):
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"), recovery={"retry_transient": True})
    with pytest.warns(NumGuardWarning, match=guard_warning("batch['x']", 3)):
        run(tmp_path, FaultData(bad_batch=3, site="input"), guard=guard, max_epochs=1)
    ckpt = tmp_path / "ng" / "last_finite.ckpt"
    state = torch.load(ckpt, weights_only=True)["callbacks"]
    (key,) = [k for k in state if "NumGuardCallback" in k]
    assert state[key]["quarantined"][0]["batch_idx"] == 3

    again = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng2"))
    t = trainer(tmp_path / "r", [again], max_epochs=2)
    t.fit(FaultModel(), loader(FaultData(bad_batch=3, site="input")), ckpt_path=str(ckpt))
    assert [q["batch_idx"] for q in again.quarantined] == [3]
    assert again.events == []  # batch 3 of epoch 1 was skipped, not trained on
    assert again.counters["skipped_steps"] >= 2


def test_snapshot_memory_is_one_copy_of_model_and_optimizer_state(tmp_path):
    guard = NumGuardCallback(action="rollback", snapshot_every_n_steps=2, dirpath=str(tmp_path / "ng"))
    model, t = run(tmp_path, FaultData(), guard=guard)
    snap = guard.snapshots.snapshot
    assert snap is not None and snap.step == 6
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # weights + buffers + AdamW's exp_avg and exp_avg_sq (+ per-param step counters, and the spike window's
    # [2, 128] float32 cube roots, restored by a rollback with the rest)
    window = 2 * 128 * 4
    assert 3 * params + buffers + window <= snap.nbytes <= 3 * params + buffers + window + 1024


def test_fp16_amp_overflow_is_left_to_the_grad_scaler(tmp_path):
    class Overflow(FaultModel):
        def _grad_hook(self, grad):
            return grad * float("inf") if self.global_step == 2 else grad

    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    model = Overflow()
    t = trainer(tmp_path, [guard], max_steps=6, plugins=[MixedPrecision("16-mixed", "cpu")], deterministic=False)
    t.fit(model, loader(FaultData()))
    assert guard.counters["amp_overflow_steps"] == 1
    assert guard.counters["incidents"] == 0 and guard.events == []
    assert t.precision_plugin.scaler.get_scale() < 65536.0  # the scaler saw the overflow and backed off
    assert all_finite(model.state_dict())


def test_a_rollbacks_last_finite_ckpt_holds_the_fits_counters(tmp_path):
    """The checkpoint a rollback writes counts the incident that made it (it lagged by one before, issue 27), and
    the rollback's event says the step it went back to (the run's picture shades the span)."""
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    with guard_warns(guard_warning("loss", 3)):
        trainer(tmp_path, [guard], max_steps=6).fit(FaultModel(site="loss", step=3), loader(FaultData()))
    last = torch.load(tmp_path / "ng" / "last_finite.ckpt", weights_only=False)
    saved = last["callbacks"][guard.state_key]
    assert saved["counters"] == guard.counters and guard.counters["incidents"] == 1
    assert saved["incidents_by_kind"] == {"nonfinite_loss": 1}
    (event,) = guard.events
    # the snapshot of the start of step 3 itself (verified finite at its read): only the bad step is given up
    assert event["action"] == "rollback" and event["details"]["snapshot_step"] == 3
