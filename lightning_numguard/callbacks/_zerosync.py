"""``NumGuardCallback(sync_mode="deferred")``: no host read on the step it checks.

The step's flag vector is packed and all-reduced on the device exactly as in the default mode, then

* the optimizer step is skipped **on the device** when any flag is set: ``found_inf`` is armed on
  the (fused) optimizer, as ``torch.amp.GradScaler`` does, so the update is a bitwise no-op, and the
  buffers the bad forward pass changed (BatchNorm statistics) are put back with ``torch.where``;
* the vector is copied to host memory without blocking (:class:`~lightning_numguard.core.pending.PendingFlags`)
  and read at the *next* optimizer step, when the copy has long landed;
* the late read decides: a clean step verifies the snapshot taken at its start
  (:class:`~lightning_numguard.core.pending.LateSnapshots`); a bad one is recorded at the step where
  it happened, and when the weights or optimizer state are no longer finite the last verified
  snapshot is restored (the step being computed is skipped on the device too), or training halts.

Under DDP with ``snapshot_sharding="auto"`` the ring's snapshots are sharded like the default mode's
(each rank keeps ``1/world`` of the parameters and optimizer state; a new candidate overwrites the
spare's slices). Capturing one is local; only a reader of the whole state gathers it
(``Recovery.full``: the late restore, a halt, the end-of-fit repair, the checkpoint swap), and
every rank reaches those together because they follow from flags reduced across ranks.

Events name the step, the site and what went bad: the batch tensors, the watched block and the op
call (from the step's records, kept one step: a device copy of the watch's small buffer and the op
guard's record list), the loss values and the non-finite state. No replay runs, so a block is not
narrowed down to its leaf module. See ``docs/performance.md``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch

from lightning_numguard.callbacks import _distributed, _sharded
from lightning_numguard.callbacks._inspector import StepRecord
from lightning_numguard.core import checks, flags, policy
from lightning_numguard.core.findings import Finding, mark_consequences, merge
from lightning_numguard.core.opguard import OpGuard
from lightning_numguard.core.pending import (
    LateSnapshots,
    PendingFlags,
    arm_device_skip,
    disarm_device_skip,
    supports_device_skip,
)
from lightning_numguard.core.quarantine import position_key
from lightning_numguard.core.snapshot import Snapshot, capture
from lightning_numguard.errors import NumGuardConfigError

if TYPE_CHECKING:
    from lightning_numguard.callbacks.numguard import NumGuardCallback

__all__ = ["SYNC_MODES", "DeferredSync"]

log = logging.getLogger(__name__)

SYNC_MODES = ("every_step", "deferred")

#: The finding kind of each flag slot when only the flag is known.
_SLOT_KIND = {
    flags.OUTPUT: ("nonfinite_output", "a watched module"),
    flags.OP: ("op_domain", "a guarded op"),
    flags.NORMS: ("nonfinite_grad", "a gradient"),
}


class DeferredSync:
    """The deferred read of one fit: device-side skips, flags read one step late, late-verified snapshots."""

    def __init__(self) -> None:
        self.pending = PendingFlags()
        self.snapshots: LateSnapshots[Snapshot] = LateSnapshots()
        self.records: dict[int, StepRecord] = {}
        self.kept: dict[int, tuple[Any, list[Any]]] = {}  # per step: the watch's and op guard's records
        self.schedules: dict[int, tuple[list[dict[str, Any]], list[list[float]]]] = {}
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._armed: list[torch.optim.Optimizer] = []
        self._spare: Snapshot | None = None
        self._shard: tuple[int, int] | None = None  # (rank, world) when the ring's snapshots are sharded

    # ------------------------------------------------------------------ fit start

    def at_fit_start(self, guard: NumGuardCallback, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse what a device-side skip cannot serve; the fit-start state becomes the first verified snapshot."""
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise NumGuardConfigError(
                "`sync_mode='deferred'` cannot be used with fp16 AMP: the GradScaler owns `found_inf`; "
                "use precision='bf16-mixed' or sync_mode='every_step'"
            )
        if not pl_module.automatic_optimization or len(trainer.optimizers) != 1:
            raise NumGuardConfigError(
                "`sync_mode='deferred'` needs automatic optimization with one optimizer; use sync_mode='every_step'"
            )
        optimizer = trainer.optimizers[0]
        if guard.action != "warn" and not supports_device_skip(optimizer):
            raise NumGuardConfigError(
                f"`sync_mode='deferred'` skips a bad step on the device through `found_inf`, which "
                f"{type(optimizer).__name__} ignores unless it is fused: create it with `fused=True` "
                f"(e.g. torch.optim.AdamW(params, fused=True)), or use sync_mode='every_step'"
            )
        self._shard = _sharded.shard_among(trainer, guard._recovery.snapshot_sharding)
        start = guard._inspector._start_buffer_map
        self._buffers = [(b, start[n]) for n, b in pl_module.named_buffers() if n in start]
        if guard._recovery.snapshot is not None:
            self.snapshots.add(guard._recovery.snapshot.step, guard._recovery.snapshot)
            self.snapshots.verified(guard._recovery.snapshot.step)

    # ------------------------------------------------------------------ the step

    def before_step(
        self, guard: NumGuardCallback, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """Pack and reduce the flags, arm the device skip, push the flags, act on the previous step's."""
        inspector = guard._inspector
        rec = inspector.record
        assert rec is not None
        rec.read_done = True
        rec.step = trainer.global_step
        due = guard.action != "warn" and policy.snapshot_due(
            guard.action, trainer.global_step, guard._recovery.last_snapshot_step, guard.snapshot_every_n_steps
        )
        packed = pack(inspector, trainer, pl_module, optimizer, due)
        n = len(flags.SLOTS)
        if guard.action != "warn":
            bad = packed[:n].amax() > 0
            if guard._spike.acting and packed.numel() > n:  # a spike is skipped on the device too
                bad = bad | guard._spike.device_flag(packed[n:])
            if rec.forced_skip is not None:
                bad = torch.ones((), dtype=torch.bool, device=packed.device)
                guard.counters["skipped_steps"] += 1
            arm_device_skip(optimizer, bad)
            self._armed.append(optimizer)
            for live, start in self._buffers:  # the bad forward pass's buffer updates, undone on the device
                live.copy_(torch.where(bad, start, live))
        self.records[rec.step] = rec
        watch, opguard = inspector.watch, inspector.opguard
        self.kept[rec.step] = (
            watch.keep() if watch is not None and watch.enabled else None,
            opguard.records if opguard is not None else [],  # reset() starts a new list: this one stays
        )
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        if schedulers:  # host-side and tiny: what a late hit puts back, as a rollback would
            lrs = [[g["lr"] for g in o.param_groups] for o in trainer.optimizers]
            self.schedules[rec.step] = ([s.state_dict() for s in schedulers], lrs)
        late = self.pending.push(packed, rec.step)
        restored = False
        if late is not None:
            restored = self.late(guard, trainer, pl_module, *late, optimizer=optimizer)
        if due and not restored:  # the state at this step's start, verified when this step's flags read clean
            snap = capture(
                pl_module,
                trainer.optimizers,
                guard._recovery.stateful,
                step=rec.step,
                where="host" if guard.snapshot_device == "host" else "device",
                rng=rec.start_rng,
                model_state=rec.start_buffers,
                stateful_state=rec.start_states,
                reuse=self._spare,
                shard_among=self._shard,  # no collective here: only the restores gather, on every rank
            )
            self._spare = None
            guard._recovery.last_snapshot_step = rec.step
            self.snapshots.add(rec.step, snap)

    def _verified(self, guard: NumGuardCallback, step: int) -> None:
        """Promote the candidates up to ``step``; the snapshot they replace becomes the spare storage."""
        before = self.snapshots.last
        self.snapshots.verified(step)
        last = self.snapshots.last
        if last is not None and last is not before:
            if before is not None:
                self._spare = before[1]
            guard._recovery.snapshot = last[1]  # what checkpoints and a halt fall back to: verified only

    def after_step(self) -> None:
        """Remove ``found_inf`` once the optimizer has used it."""
        for optimizer in self._armed:
            disarm_device_skip(optimizer)
        self._armed.clear()

    def at_train_end(self, guard: NumGuardCallback, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read what is still pending (the last step's flags): one read per fit."""
        late = self.pending.pop()
        if late is not None:
            self.late(guard, trainer, pl_module, *late, optimizer=None)
        self.after_step()

    # ------------------------------------------------------------------ the late read

    def late(
        self,
        guard: NumGuardCallback,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        values: list[float],
        optimizer: Any,
    ) -> bool:
        """Step ``step``'s flags, read one step late: verify its snapshot, or record and act on its incident.

        Returns whether the live state was restored from a snapshot.
        """
        rec = self.records.pop(step, None)
        schedule = self.schedules.pop(step, None)
        kept_records = self.kept.pop(step, (None, []))
        for kept in (self.records, self.schedules, self.kept):
            for old in [s for s in kept if s < step]:
                del kept[old]
        n = len(flags.SLOTS)
        seen = flags.decode(values[:n], trainer.world_size)
        spikes: list[Finding] = []
        if len(values) > n:  # the spike statistics of that step; its overflow risks are recorded now
            spikes, risks = guard._spike.findings(values[n:], step, guard._inspector.watch, trainer.world_size)
            guard._ledger.record(trainer, [guard._ledger.event(trainer, f, step, "none") for f in risks])
        quiet = seen.seen(flags.QUARANTINE)  # a quarantined batch, skipped on the device without an incident
        if quiet and rec is not None and rec.forced_skip is None:
            guard.counters["skipped_steps"] += 1
        if spikes and not seen.any and (rec is None or rec.forced_skip is None):
            return self._late_spike(guard, trainer, pl_module, step, rec, spikes, schedule, optimizer)
        if not seen.any or quiet or (rec is not None and rec.forced_skip is not None):
            if not seen.any:
                guard._conventions.clean_step()
            if seen.seen(flags.NORMS):  # gradients or state non-finite: its snapshot is not verified
                self.snapshots.discard_from(step)
            else:
                self._verified(guard, step)
            return False
        recovery = guard._recovery
        if rec is not None:
            key = position_key(rec.batch, rec.batch_idx)
            recovery.quarantine.count_failure(key)
            if recovery.use_quarantine and recovery.quarantine.failures.get(key, 0) >= 2:
                recovery.quarantine_batch(trainer, rec, "failed at the same position more than once")
        self.snapshots.discard_from(step)
        if guard.action == "warn":
            state_bad: list[str] = []
            state_rank = -1
        else:  # exact, after a hit only
            named = guard._inspector.state(trainer, with_optimizer=True)
            bad = [n for (n, _), b in zip(named, checks.confirm_nonfinite([t for _, t in named])) if b]
            state_bad, state_rank = _distributed.first_rank(trainer, bad)
        action = policy.decide(
            guard.action,
            state_bad=bool(state_bad),
            has_incident=True,
            have_snapshot=self.snapshots.last is not None,
            rollbacks_used=guard._recovery.rollbacks_this_fit,
            max_rollbacks=guard.max_rollbacks,
        )
        if action == "rollback" and not state_bad:  # the device skip undid the step: nothing is restored, say skip
            action = "skip"
        findings = describe(seen, rec, state_bad, state_rank, trainer.global_rank, guard.max_abs_input)
        placed = located(guard, kept_records, trainer.global_rank) if seen.any_local() else {}
        findings = [placed.get(f.kind, [f])[0] if f.where[0] in _PLACEHOLDERS else f for f in findings]
        findings = merge([findings, placed.get("op_domain", [])])  # in causal order, without duplicates
        findings = _across_ranks(trainer, findings)  # every rank is here together: the flags were reduced
        mark_consequences(findings)
        epoch, batch_idx = (rec.epoch, rec.batch_idx) if rec is not None else (None, -1)
        # a field flagged step after step: the device already skipped this step; later steps leave the field out
        _, declared = guard._conventions.sort(findings)
        events = guard._conventions_declared(trainer, declared, step, epoch, batch_idx)
        for f in findings:
            f.details.update({"deferred": True, "read_at_step": trainer.global_step})
            events.append(guard._ledger.event(trainer, f, step, action, epoch, batch_idx))
        if action != "warn":
            guard.counters["skipped_steps"] += 1  # the device skipped it
        if action == "rollback":
            guard.counters["rollbacks"] += 1
            guard._recovery.rollbacks_this_fit += 1
        if action != "warn":
            _put_back_schedule(trainer, schedule)
        restored = action in ("rollback", "halt")  # a rollback only when the state itself went bad
        if restored:  # every rank is here together (the flags and state_bad were merged across ranks)
            assert self.snapshots.last is not None
            guard._recovery.snapshot = self.snapshots.last[1]
            if action != "halt":  # a halt restores (and gathers) once, below
                guard._recovery.restore(trainer, pl_module)  # collective when the snapshot is sharded
            if optimizer is not None:  # the step in flight started from the damaged state: skip it too
                _skip_step_in_flight(guard, optimizer, pl_module)
        guard._ledger.record(trainer, events)
        if action == "halt":
            guard._recovery.halt(trainer, pl_module)
        log.info("numguard (deferred) step %s was bad, read at step %s: %s", step, trainer.global_step, action)
        return restored

    def _late_spike(
        self,
        guard: NumGuardCallback,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        rec: StepRecord | None,
        spikes: list[Finding],
        schedule: Any,
        optimizer: Any,
    ) -> bool:
        """A finite spike of step ``step``, read late (the device skipped it when ``spike_action`` acts): record it,
        and roll back when its action says so. Returns whether the live state was restored."""
        recovery = guard._recovery
        wanted = guard._spike.decide(step)
        if wanted != "warn":  # the state that spiked is not one to come back to
            self.snapshots.discard_from(step)
        action = policy.decide(
            wanted,
            state_bad=False,
            has_incident=True,
            have_snapshot=self.snapshots.last is not None,
            rollbacks_used=recovery.rollbacks_this_fit,
            max_rollbacks=guard.max_rollbacks,
        )
        guard.counters["spikes"] += 1
        epoch, batch_idx = (rec.epoch, rec.batch_idx) if rec is not None else (None, -1)
        events = []
        for f in spikes:
            f.details.update({"deferred": True, "read_at_step": trainer.global_step})
            if wanted != guard.spike_action:
                f.details["escalated"] = f"{guard.spike_rollback_after} spikes within {guard.spike_window} steps"
            events.append(guard._ledger.event(trainer, f, step, action, epoch, batch_idx))
        restored = action in ("rollback", "halt")
        if action != "warn":
            guard.counters["skipped_steps"] += 1  # the device skipped it
            _put_back_schedule(trainer, schedule)
        if action == "rollback":
            guard.counters["rollbacks"] += 1
            assert self.snapshots.last is not None
            recovery.snapshot = self.snapshots.last[1]
            recovery.restore(trainer, pl_module)  # collective when sharded: every rank read the same flags
            recovery.after_rollback(trainer, events)  # the skip window and the LR back-off
            if optimizer is not None:  # the step in flight started from the state the rollback replaced
                _skip_step_in_flight(guard, optimizer, pl_module)
        guard._ledger.record(trainer, events)
        if action == "halt":
            guard._recovery.halt(trainer, pl_module)
        log.info("numguard (deferred) step %s spiked, read at step %s: %s", step, trainer.global_step, action)
        return restored


def _skip_step_in_flight(guard: NumGuardCallback, optimizer: Any, pl_module: pl.LightningModule) -> None:
    """The step in flight at a late rollback started from the replaced state: skipped on the device, and its own
    late read is not a new incident."""
    arm_device_skip(optimizer, torch.ones((), device=pl_module.device))
    current = guard._inspector.record
    if current is not None and current.forced_skip is None:
        current.forced_skip = "it started from the state a late rollback replaced"
        guard.counters["skipped_steps"] += 1


def _put_back_schedule(trainer: pl.Trainer, schedule: Any) -> None:
    """The LR schedule as a bad step found it (kept per step in ``DeferredSync.schedules``)."""
    if schedule is None:
        return
    for config, state in zip(trainer.lr_scheduler_configs, schedule[0]):
        config.scheduler.load_state_dict(state)
    for opt, lrs in zip(trainer.optimizers, schedule[1]):
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr


def pack(
    inspector: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, snapshot_due: bool
) -> torch.Tensor:
    """The step's reduced flag vector, on the device (``StepInspector.read`` without its host read), followed by
    the spike statistics' raw values when the step carries them (not rank-encoded; the same all-reduce)."""
    slots, _ = inspector.slot_values(trainer, pl_module, optimizer, snapshot_due)
    extras, inspector.extras = inspector.extras, None
    return inspector.reduce(trainer, slots, extras)


_PLACEHOLDERS = {where for _, where in _SLOT_KIND.values()}


def _across_ranks(trainer: pl.Trainer, findings: list[Finding]) -> list[Finding]:
    """Every rank's findings merged (a gather: only after a hit), so that each rank records the same events.

    A rank that only saw a slot's flag (``"a watched module"``) drops that placeholder when another rank
    named the place from its own records.
    """
    if trainer.world_size <= 1:
        return findings
    merged = merge(_distributed.gather(trainer, findings))
    named = {f.kind for f in merged if not (f.where and f.where[0] in _PLACEHOLDERS)}
    return [f for f in merged if not (f.where and f.where[0] in _PLACEHOLDERS and f.kind in named)]


def located(guard: NumGuardCallback, kept: tuple[Any, list[Any]], rank: int) -> dict[str, list[Finding]]:
    """The bad block and the bad op calls of a past step, from the records kept for it (syncs)."""
    watch_kept, op_records = kept
    out: dict[str, list[Finding]] = {}
    watch = guard._inspector.watch
    if watch is not None and watch_kept is not None:
        bad = watch.first_bad(watch_kept)
        if bad:
            first, lo, hi = bad[0]
            details = {"min": lo, "max": hi, "also": [m for m, _, _ in bad[1:6]]}
            out["nonfinite_output"] = [Finding("nonfinite_output", [first], details, rank)]
    if op_records:
        flags_now = torch.stack([r.flag.to(torch.float32).cpu() for r in op_records]).tolist()
        ops = [
            Finding("op_domain", [r.op] + ([r.module] if r.module else []), dict(OpGuard.describe(r)), rank)
            for r, f in zip(op_records, flags_now)
            if f
        ]
        if ops:
            out["op_domain"] = ops
    return out


def describe(
    seen: flags.StepFlags,
    rec: StepRecord | None,
    state_bad: list[str],
    state_rank: int,
    rank: int,
    max_abs: float | None,
) -> list[Finding]:
    """Findings from the flags of a past step, its kept batch and losses, and the state now (syncs).

    ``state_bad``: the non-finite state on any rank; ``state_rank``: the lowest rank where it was. The loss
    finding, with this rank's loss values, is made on the lowest rank that saw the loss slot only; the cross-rank
    merge gives it to every rank.
    """
    out: list[Finding] = []
    if rec is not None and (seen.seen(flags.INPUT) or seen.seen(flags.SUSPICIOUS)):
        for leaves, _ in rec.inputs:
            values = checks.max_abs([t for _, t in leaves]).tolist()
            unmasked = checks.max_abs([t for _, t in leaves], masks_as_zero=True).tolist()  # finfo.min: a mask
            bad = [p for (p, _), v in zip(leaves, values) if v != v or v in (float("inf"), float("-inf"))]
            huge = [p for (p, _), v in zip(leaves, unmasked) if max_abs is not None and p not in bad and v >= max_abs]
            if bad:
                out.append(Finding("nonfinite_input", bad, {}, rank))
            elif huge:
                out.append(Finding("suspicious_input", huge, {"threshold": max_abs}, rank))
    if state_bad:
        out.append(Finding("nonfinite_param", state_bad, {}, state_rank))
    for slot in (flags.OUTPUT, flags.OP):
        if seen.seen(slot):
            kind, where = _SLOT_KIND[slot]
            out.append(Finding(kind, [where], {}, seen.rank(slot)))
    if seen.rank(flags.LOSS) == rank:
        values = [float(x.float().mean()) for x in rec.losses] if rec is not None else []
        out.append(Finding("nonfinite_loss", ["loss"], {"values": values}, seen.rank(flags.LOSS)))
    if not out and seen.seen(flags.NORMS):
        kind, where = _SLOT_KIND[flags.NORMS]
        out.append(Finding(kind, [where], {}, seen.rank(flags.NORMS)))
    return out
