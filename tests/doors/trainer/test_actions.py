"""warn / skip / halt on real Trainers with faults injected at a chosen step and site."""

from __future__ import annotations

import glob
import os
from typing import ClassVar

import pytest
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint

from instruments.syncs import SyncCounter
from lightning_numguard import NonFiniteError, NumGuardCallback, NumGuardConfigError, NumGuardError
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import (
    EVERY_CHECK,
    SITE_CULPRIT,
    SITE_WARNING,
    FaultData,
    FaultModel,
    SyncWindow,
    all_finite,
    guard_warning,
    guard_warns,
    loader,
    trainer,
)

EXPECTED_FIRST = {
    "input": ("nonfinite_input", "batch['x']"),
    "masked": ("suspicious_input", "batch['x']"),
    "output": ("nonfinite_output", "body.1"),
    "loss": ("nonfinite_loss", "loss"),
    "grad": ("nonfinite_grad", "head.weight"),
    "param": ("nonfinite_param", "body.0.weight"),
    "buffer": ("nonfinite_param", "body.2.running_var"),
    "op": ("op_domain", "binary_cross_entropy"),
}


def fit(tmp_path, site, action, step=3, max_steps=8, extra=(), guard_kwargs=None, **kw):
    guard = NumGuardCallback(action=action, dirpath=str(tmp_path / "ng"), **(guard_kwargs or {}))
    model = FaultModel(site=site, step=step)
    t = trainer(tmp_path, [guard, *extra], max_steps=max_steps, **kw)
    t.fit(model, loader(FaultData(bad_batch=step, site=site or "none")))
    return guard, model, t


def ckpt_files(folder):
    return sorted(glob.glob(os.path.join(folder, "**", "*.ckpt"), recursive=True))


@pytest.mark.parametrize("site", sorted(EXPECTED_FIRST))
def test_warn_names_the_first_culprit(tmp_path, site):
    # under warn nothing is replayed: module outputs are named by the per-step forward hooks
    kind, where = EXPECTED_FIRST[site]
    with guard_warns(guard_warning(where, 3)):  # under warn the damage stays: later steps warn of it too
        guard, _, t = fit(tmp_path, site, "warn", max_steps=5, guard_kwargs={"check": EVERY_CHECK})
    first = guard.events[0]
    assert (first["kind"], first["where"][0]) == (kind, where)
    assert first["step"] == 3 and first["batch_idx"] == 3 and first["rank"] == 0
    assert first["action"] == "warn"
    assert t.global_step == 5


def test_no_events_on_a_clean_run(tmp_path):
    guard, model, _ = fit(tmp_path, None, "rollback")
    assert guard.events == []
    assert guard.counters["incidents"] == 0
    assert all_finite(model.state_dict())


@pytest.mark.parametrize("site", sorted(EXPECTED_FIRST))
def test_default_checks_name_the_first_culprit(tmp_path, site):
    """Without per-step output hooks, the replay of the bad batch names the module."""
    kind, where = EXPECTED_FIRST[site]
    with pytest.warns(NumGuardWarning, match=guard_warning(where, 3)):
        guard, _, _ = fit(tmp_path, site, "skip")
    first = guard.events[0]
    assert (first["kind"], first["where"][0]) == (kind, where)
    assert first["step"] == 3


@pytest.mark.parametrize("site", ["input", "output", "loss", "grad"])
def test_skip_makes_the_step_a_bitwise_no_op(tmp_path, site):
    class Capture(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                self.before = {k: v.clone() for k, v in pl_module.state_dict().items()}
                opt = trainer.optimizers[0]
                self.opt_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                self.after = {k: v.clone() for k, v in pl_module.state_dict().items()}
                opt = trainer.optimizers[0]
                self.opt_after = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}

    cap = Capture()
    with pytest.warns(NumGuardWarning, match=guard_warning(EXPECTED_FIRST[site][1], 3)):
        guard, model, _ = fit(tmp_path, site, "skip", extra=[cap])
    assert guard.counters["skipped_steps"] == 1
    assert cap.before.keys() == cap.after.keys()
    for key in cap.before:  # weights and BatchNorm buffers, bitwise
        assert torch.equal(cap.before[key], cap.after[key]), key
    for pid, state in cap.opt_before.items():  # AdamW moments and step count did not move
        for k, v in state.items():
            assert torch.equal(v, cap.opt_after[pid][k]), k
    assert all_finite(model.state_dict())
    assert {e["action"] for e in guard.events} == {"skip"}


def test_skip_escalates_to_rollback_when_the_weights_are_no_longer_finite(tmp_path):
    with pytest.warns(NumGuardWarning, match=guard_warning("body.0.weight", 3)):
        guard, model, _ = fit(tmp_path, "param", "skip")
    assert guard.events[0]["kind"] == "nonfinite_param"
    assert guard.events[0]["action"] == "rollback"
    assert guard.counters["rollbacks"] == 1
    assert all_finite(model.state_dict())


# Lightning's own remarks on this setup, not the guard's: OnExceptionCheckpoint's default ckpt_path="last" in a
# fit that starts from nothing, and a resume from the mid-epoch last_finite.ckpt without the callbacks that wrote it
@pytest.mark.filterwarnings(
    "ignore:`.fit.ckpt_path=None.` was called without a model",
    "ignore:.fit.ckpt_path=.last.. is set, but there is no last checkpoint",
    "ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint",
    "ignore:You're resuming from a checkpoint that ended before the epoch ended",
)
@pytest.mark.parametrize("site", ["input", "param", "opt_state"])
def test_halt_saves_the_last_finite_state_and_no_callback_saves_poison(tmp_path, site):
    ckpt_dir = tmp_path / "ckpts"
    saver = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=-1)
    on_exc = OnExceptionCheckpoint(dirpath=str(tmp_path / "exc"))
    guard = NumGuardCallback(action="halt", dirpath=str(tmp_path / "ng"))
    model = FaultModel(site=site, step=3)
    t = trainer(tmp_path, [guard, saver, on_exc], max_steps=8, enable_checkpointing=True)
    last = tmp_path / "ng" / "last_finite.ckpt"
    # a halt is a failure: fit raises (the process exits non-zero), naming the checkpoint to resume from
    with guard_warns(guard_warning(SITE_WARNING[site])), pytest.raises(NonFiniteError) as raised:
        t.fit(model, loader(FaultData(bad_batch=3, site=site)))
    assert f"resume with trainer.fit(model, ckpt_path={str(last)!r})" in str(raised.value)
    assert "halted training at step" in str(raised.value)
    assert any(SITE_CULPRIT[site] in e["message"] for e in guard.events), [e["message"] for e in guard.events]
    assert t.state.status == "interrupted"
    assert t.global_step < 8
    assert last.exists() and not (tmp_path / "ng" / "last_finite.ckpt.tmp").exists()
    files = ckpt_files(str(tmp_path))
    assert len(files) >= 3
    for f in files:
        ckpt = torch.load(f, weights_only=False)
        assert all_finite(ckpt["state_dict"]), f
        assert all_finite(ckpt["optimizer_states"]), f
    assert all_finite(model.state_dict())
    assert any(e["action"] == "halt" for e in guard.events)
    # the guard's state in it counts the incident that made it halt (it was counted after the save before)
    saved = torch.load(last, weights_only=False)["callbacks"][guard.state_key]["counters"]
    assert saved["incidents"] == guard.counters["incidents"] >= 1
    # the saved state resumes with a normal Trainer and loads as a LightningModule
    FaultModel.load_from_checkpoint(last)
    t2 = trainer(tmp_path / "resume", [NumGuardCallback(dirpath=str(tmp_path / "ng2"))], max_steps=8)
    t2.fit(FaultModel(), loader(FaultData()), ckpt_path=str(last))
    assert t2.global_step == 8


def test_halt_raises_when_min_steps_would_keep_lightning_going(tmp_path):
    with (
        pytest.warns(NumGuardWarning, match=guard_warning("batch['x']", 3)),
        pytest.raises(NonFiniteError, match="halted training at step 3"),
    ):
        fit(tmp_path, "input", "halt", min_steps=6)
    assert (tmp_path / "ng" / "last_finite.ckpt").exists()
    ckpt = torch.load(tmp_path / "ng" / "last_finite.ckpt", weights_only=False)
    assert all_finite(ckpt["state_dict"])


def test_halt_raises_false_stops_gracefully_and_loggers_see_which(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    class Finalised(CSVLogger):
        status: ClassVar[list[str]] = []

        def finalize(self, status):
            self.status.append(status)
            super().finalize(status)

    with guard_warns(guard_warning("batch['x']", 3)):
        logger = Finalised(tmp_path)
        guard, _, t = fit(
            tmp_path,
            "input",
            "halt",
            guard_kwargs={"recovery": {"halt_raises": False}},
            logger=logger,
            log_every_n_steps=1,
        )
    assert t.should_stop and t.global_step == 4 and t.state.status == "finished"
    assert Finalised.status[-1] == "success"
    assert guard.events[0]["action"] == "halt" and (tmp_path / "ng" / "last_finite.ckpt").exists()
    # the default: the same halt fails the fit, and the loggers are finalised as failed
    Finalised.status.clear()
    with guard_warns(guard_warning("batch['x']", 3)), pytest.raises(NonFiniteError, match="at step 3"):
        fit(tmp_path / "raises", "input", "halt", logger=Finalised(tmp_path / "raises"), log_every_n_steps=1)
    assert Finalised.status == ["failed"]
    with pytest.raises(NumGuardConfigError, match=r"recovery\.halt_raises"):
        NumGuardCallback(recovery={"halt_raises": "yes"})  # type: ignore[arg-type]


def test_on_save_checkpoint_never_writes_poisoned_weights(tmp_path):
    # Adam's state goes NaN at step 3; the update makes the weights NaN; ModelCheckpoint saves at the
    # end of that step, before the next step's read could see it.
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)
    with guard_warns(guard_warning("`head.weight`", 4)):
        guard, model, _ = fit(tmp_path, "opt_state", "rollback", extra=[saver], enable_checkpointing=True)
    for f in ckpt_files(str(tmp_path / "ckpts")):
        assert all_finite(torch.load(f, weights_only=False)["state_dict"]), f
    (swap,) = [e for e in guard.events if e["where"] == ["checkpoint"]]
    assert all_finite(model.state_dict())
    # one poisoned optimizer state is one incident: the swap is a consequence of what the next read names (issue 27)
    assert swap["root_cause"] is False and swap["consequence_of"] == "nonfinite_param"
    assert guard.counters["incidents"] == 1, guard.events


def test_optimizer_state_check_catches_poisoned_moments_before_the_step(tmp_path):
    checks = ["inputs", "outputs", "loss", "grads", "params", "optimizer_state"]
    with pytest.warns(NumGuardWarning, match=guard_warning(".exp_avg_sq`", 3)):
        guard, model, _ = fit(tmp_path, "opt_state", "rollback", guard_kwargs={"check": checks})
    first = guard.events[0]
    assert first["kind"] == "nonfinite_param" and first["step"] == 3
    assert first["where"][0].endswith(".exp_avg_sq")
    assert all_finite(model.state_dict())


@pytest.mark.parametrize("snapshot_async", [False, True])
def test_at_most_one_host_sync_per_training_step(tmp_path, snapshot_async):
    """Counts the host reads the guard causes (a guard frame on the stack) during the training steps.

    With ``snapshot_async=True`` (on the CPU: a worker thread) the snapshot steps wait for the copies without
    a host read of the guard's own.
    """
    counter = SyncCounter(package="lightning_numguard")

    # the guard first, so its on_train_batch_end runs before the window closes
    guard = NumGuardCallback(
        action="rollback",
        dirpath=str(tmp_path / "ng"),
        snapshot_every_n_steps=2,
        snapshot={"asynchronous": snapshot_async},
    )
    model = FaultModel()
    t = trainer(tmp_path, [SyncWindow(counter), guard], max_steps=8)
    t.callbacks = [c for c in t.callbacks if c is not guard] + [guard]
    with counter:
        t.fit(model, loader(FaultData()))
    assert len(counter.step_total) == 8
    assert counter.caused == 8, counter.sites  # exactly one read per step, snapshot steps included
    assert guard.snapshots.async_on is snapshot_async
    assert guard.snapshots.snapshot is not None and guard.snapshots.snapshot.step == 6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"action": "explode"},
            r"`action` must be one of \['warn', 'skip', 'rollback', 'halt'\], got 'explode'",
        ),
        ({"check": ["inputs", "weights"]}, r"`check` must be one of .*got 'weights'"),
        ({"check": "inputs"}, r"`check` must be a list of strings"),
        ({"max_abs_input": -1.0}, r"`max_abs_input` must be a positive number or None, got -1.0"),
        ({"max_abs_input": "big"}, r"`max_abs_input` must be a positive number or None, got 'big'"),
        (
            {"check_optimizer_coverage": "loud"},
            r"`check_optimizer_coverage` must be one of \['off', 'warn', 'error'\]",
        ),
        ({"snapshot_every_n_steps": 0}, r"`snapshot_every_n_steps` must be an integer >= 1, got 0"),
        ({"snapshot_every_n_steps": 2.5}, r"`snapshot_every_n_steps` must be an integer >= 1, got 2.5"),
        ({"snapshot": {"device": "gpu"}}, r"`snapshot.device` must be one of \['host', 'device'\], got 'gpu'"),
        ({"snapshot": {"sharding": "on"}}, r"`snapshot.sharding` must be one of \['auto', 'off'\], got 'on'"),
        ({"max_rollbacks": -1}, r"`max_rollbacks` must be an integer >= 0, got -1"),
        (
            {"skip_batches_after_rollback": True},
            r"`skip_batches_after_rollback` must be an integer >= 0, got True",
        ),
        ({"lr_backoff": 0.0}, r"`lr_backoff` must be a number in \(0, 1\], got 0.0"),
        ({"lr_backoff": 1.5}, r"`lr_backoff` must be a number in \(0, 1\], got 1.5"),
        ({"recovery": {"retry_transient": "yes"}}, r"`recovery.retry_transient` must be True or False, got 'yes'"),
        ({"recovery": {"quarantine": 1}}, r"`recovery.quarantine` must be True or False, got 1"),
        ({"recovery": {"replay": None}}, r"`recovery.replay` must be True or False, got None"),
        ({"watch": {"modules": "encoder.*"}}, r"`watch.modules` must be a list of glob patterns"),
        ({"watch": {"ignore": [1]}}, r"`watch.ignore` must be a list of glob patterns"),
        ({"dirpath": 3}, r"`dirpath` must be a path or None, got 3"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs, match):
    with pytest.raises(NumGuardConfigError, match=match) as err:
        NumGuardCallback(**kwargs)
    assert isinstance(err.value, ValueError)


def test_coverage_reports_frozen_layers_once_and_can_raise(tmp_path):
    class Frozen(FaultModel):
        def configure_optimizers(self):
            self.body[0].requires_grad_(False)
            return torch.optim.Adam(self.parameters())  # the RCAN mistake

    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match=r"frozen parameters .* handed to an optimizer: `body.0.weight`"):
        trainer(tmp_path, [guard], max_steps=3).fit(Frozen(), loader(FaultData()))
    coverage = [e for e in guard.events if e["kind"] == "optimizer_coverage"]
    assert len(coverage) == 1 and coverage[0]["where"] == ["body.0.weight", "body.0.bias"]
    assert coverage[0]["action"] == "none"

    strict = NumGuardCallback(dirpath=str(tmp_path / "ng2"), check_optimizer_coverage="error")
    with (
        pytest.warns(NumGuardWarning, match="frozen parameters"),
        pytest.raises(NumGuardError, match="frozen parameters"),
    ):
        trainer(tmp_path, [strict], max_steps=3).fit(Frozen(), loader(FaultData()))
    off = NumGuardCallback(dirpath=str(tmp_path / "ng3"), check_optimizer_coverage="off")
    trainer(tmp_path, [off], max_steps=3).fit(Frozen(), loader(FaultData()))
    assert off.events == []


def test_coverage_reports_params_that_never_get_a_gradient(tmp_path):
    class Unused(FaultModel):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(2, 2)

    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="received no gradient"):
        trainer(tmp_path, [guard], max_steps=3).fit(Unused(), loader(FaultData()))
    (event,) = [e for e in guard.events if e["kind"] == "optimizer_coverage"]
    assert event["where"] == ["unused.weight", "unused.bias"]


def test_large_finite_gradients_are_not_incidents(tmp_path):
    class Huge(FaultModel):
        def _grad_hook(self, grad):
            return grad * 0 + 1e30 if self.global_step == 2 else grad

    guard = NumGuardCallback(action="skip", dirpath=str(tmp_path / "ng"))
    trainer(tmp_path, [guard], max_steps=4).fit(Huge(), loader(FaultData()))
    assert guard.events == []


def test_gradient_accumulation_attributes_the_bad_micro_batch(tmp_path):
    with pytest.warns(NumGuardWarning, match=guard_warning("batch['x']", 0)):
        guard, model, t = fit(tmp_path, "input", "rollback", step=1, max_steps=4, accumulate_grad_batches=2)
    # batch 1 (poisoned by FaultData(bad_batch=1)) is the second micro-batch of step 0
    first = guard.events[0]
    assert first["kind"] == "nonfinite_input"
    assert first["step"] == 0
    assert guard.counters["rollbacks"] == 1
    assert all_finite(model.state_dict())
    assert t.global_step == 4


def test_manual_optimization_with_two_optimizers(tmp_path):
    class GanLike(FaultModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt_body, opt_head = self.optimizers()
            loss = torch.nn.functional.mse_loss(self(batch["x"]), batch["y"])
            opt_body.zero_grad()
            opt_head.zero_grad()
            self.manual_backward(loss)
            opt_body.step()
            if self.global_step == 7:  # counts both optimizers' steps: the 4th batch's second step
                self.head.weight.grad.fill_(float("nan"))
            opt_head.step()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.body.parameters(), lr=0.01), torch.optim.SGD(self.head.parameters(), lr=0.01)

    guard = NumGuardCallback(action="skip", dirpath=str(tmp_path / "ng"))
    model = GanLike()
    with pytest.warns(NumGuardWarning, match="head.weight"):
        trainer(tmp_path, [guard], max_steps=12).fit(model, loader(FaultData()))
    (event,) = guard.events
    assert event["kind"] == "nonfinite_grad" and event["where"][0] == "head.weight"
    assert event["batch_idx"] == 3
    assert all_finite(model.state_dict())


def test_skip_escalates_on_poisoned_optimizer_state(tmp_path):
    with pytest.warns(NumGuardWarning, match=guard_warning(SITE_WARNING["opt_state"])):
        guard, model, _ = fit(tmp_path, "opt_state", "skip")
    assert any(".exp_avg_sq" in e["message"] for e in guard.events), [e["message"] for e in guard.events]
    assert guard.events[0]["kind"] == "nonfinite_param"
    assert guard.events[0]["action"] == "rollback"
    assert all_finite(model.state_dict())


def test_buffers_non_finite_by_design_are_left_unchecked(tmp_path):
    class Masked(FaultModel):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.register_buffer("causal_mask", torch.triu(torch.full((4, 4), float("-inf")), diagonal=1))

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    model = Masked()
    trainer(tmp_path, [guard, saver], max_steps=6, enable_checkpointing=True).fit(model, loader(FaultData()))
    assert guard.events == []
    assert torch.isneginf(model.causal_mask).sum() == 6
    # a real fault is still caught, and the rollback keeps the mask as it was
    model = Masked(site="buffer", step=3)
    with pytest.warns(NumGuardWarning, match="running_var"):
        trainer(tmp_path, [guard], max_steps=6).fit(model, loader(FaultData()))
    assert [e["where"] for e in guard.events] == [["body.2.running_var"]]
    assert torch.isneginf(model.causal_mask).sum() == 6


@pytest.mark.parametrize(
    ("state", "key"),
    [
        ({"counters": {"rollbacks": "many"}}, "counters"),
        ({"counters": [1, 2]}, "counters"),
        ({"quarantined": [{"epoch": 0}]}, "quarantined"),
        ({"position_incidents": {"batch:3": None}}, "position_incidents"),
        # the spike steps are valid, the window is not: neither is taken
        ({"spike": {"spike_steps": [3], "window": {"values": [1.0, 2.0]}}}, "spike"),
        ({"spike": {"spike_steps": [3], "window": {"values": [[1.0], [2.0], [3.0]]}}}, "spike"),
    ],
)
def test_malformed_callback_state_is_refused_and_nothing_changes(state, key):
    guard = NumGuardCallback()
    guard.load_state_dict({"counters": {"rollbacks": 2}, "quarantined": [{"batch_idx": 1, "step": 4}]})
    before = guard.state_dict()
    with pytest.raises(NumGuardError, match=rf"malformed at '{key}'.*weights are unaffected"):
        guard.load_state_dict(state)
    assert guard.state_dict() == before


@pytest.mark.parametrize("version", [2, "1", None])
def test_a_callback_state_of_an_unknown_version_is_refused_naming_the_fix(version):
    guard = NumGuardCallback()
    before = guard.state_dict()
    assert before["version"] == 1
    with pytest.raises(NumGuardError, match=rf"version {version!r}.*upgrade lightning-numguard.*removing"):
        guard.load_state_dict({**before, "version": version, "counters": {"rollbacks": 5}})
    assert guard.state_dict() == before
    guard.load_state_dict({"counters": {"rollbacks": 5}})  # a state written before versions: version 1
    assert guard.counters["rollbacks"] == 5
