"""``NumGuardCallback(sync_mode="deferred")``: the read schedule with no host read on the step it checks.

The step's flag vector is packed and all-reduced on the device exactly as in the default mode
(:meth:`StepRead.pack <lightning_numguard.engine.read.StepRead.pack>`), then

* the optimizer step is skipped **on the device** when any flag is set (:class:`DeviceSkip`: ``found_inf`` armed
  on the fused optimizer, as ``torch.amp.GradScaler`` does, and the buffers the bad forward pass changed put back
  with ``torch.where``);
* the vector is copied to host memory without blocking (:class:`~lightning_numguard.engine.pending.PendingFlags`)
  and read at the *next* optimizer step, when the copy has long landed;
* that late read goes through the same pipeline as the default mode's read
  (:meth:`StepPipeline.judge <lightning_numguard.engine.pipeline.StepPipeline.judge>`): the one findings
  builder, from the records kept for the step, and the one judge. A clean step verifies the snapshot
  candidate taken at its start; a restore it decides is carried out at the end of the batch in flight,
  whose own optimizer step is skipped on the device too.

Under DDP with ``snapshot_sharding="auto"`` the candidates are sharded like the default mode's snapshots;
capturing one is local, and only a reader of the whole state gathers it (every rank reaches those together,
because they follow from flags reduced across ranks). No replay runs, so a block is not narrowed down to its
leaf module. See ``docs/performance.md``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from lightning_numguard.decide.judge import Decision
from lightning_numguard.detect import checks, flags, registry
from lightning_numguard.diagnose.builder import StateLook, StepView
from lightning_numguard.diagnose.findings import AFTER_FORWARD, Finding, merge
from lightning_numguard.engine import group
from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.pending import (
    LateSnapshots,
    PendingFlags,
    arm_device_skip,
    disarm_device_skip,
    supports_device_skip,
)
from lightning_numguard.engine.pipeline import StepPipeline
from lightning_numguard.engine.read import Reading
from lightning_numguard.engine.record import StepRecord
from lightning_numguard.engine.schedule import ReadSchedule
from lightning_numguard.errors import NumGuardConfigError
from lightning_numguard.state.snapshot import Snapshot
from lightning_numguard.state.snapshots import LateCandidates, Snapshots

__all__ = ["Candidates", "Deferred", "DeviceSkip", "LateView"]


@dataclass
class LateView(StepView):
    """A step read one step late, as the findings builder sees it: the records kept for the step (the watch's and
    the op guard's) instead of the live instruments, the state now instead of the step's gradients and buffers, no
    replay, and a slot that no rank can name any more reported by its flag."""

    #: the watch's kept buffer and the op guard's records of the step
    kept_watch: Any = None
    kept_ops: list[Any] | None = None
    #: the parts of the ``NORMS`` slot (``"grads"``, ``"live_buffers"``, ...) and their totals then
    norms: tuple[list[str], torch.Tensor] | None = None
    #: the loop's number of ranks (each rank's kept totals are its own)
    world_size: int = 1
    late: ClassVar[bool] = True

    @functools.cached_property
    def buffer_written(self) -> bool:
        """Whether the step's kept totals say a buffer went non-finite during it, the weights, the optimizer state and
        the buffers it started from finite (one process only: every rank must record the same events). Read once,
        after a hit, when a finding first asks."""
        return self.world_size == 1 and _written_during(self.norms)

    def look(self, loop: Loop, reader: Any, exact: bool) -> StateLook:
        """The state now, one step after the fault: what a rollback would judge (the step's gradients are gone)."""
        if not exact:
            return StateLook()
        named = reader.state(loop, with_optimizer=True)
        bad = [n for (n, _), b in zip(named, checks.confirm_nonfinite([t for _, t in named])) if b]
        state_bad, rank = group.first_rank(loop, bad)
        return StateLook(state_bad, [Finding("nonfinite_param", state_bad, {}, rank)] if state_bad else [])

    def bad_blocks(self, watch: Any) -> list[tuple[str, float]]:
        return watch.first_bad(self.kept_watch) if watch is not None and self.kept_watch is not None else []

    def op_records(self, recorder: Any) -> list[Any]:
        return list(self.kept_ops or [])

    @property
    def replays(self) -> bool:
        return False  # the step's state is gone: the state now is a step later

    def op_finding(self, finding: Finding, module: str | None, upstream: str | None) -> Finding:
        return finding  # named by the op and the module the op guard saw

    def complete(self, findings: list[Finding]) -> list[Finding]:
        """A slot seen on some rank whose place no rank could name is reported by its flag (the ``NORMS`` slot by
        the part of it that went bad, from its kept totals: a gradient, a buffer, a parameter...)."""
        seen = self.reading.flags
        kinds = {f.kind for f in findings}
        out = list(findings)
        for slot, kind in ((flags.OUTPUT, "nonfinite_output"), (flags.OP, "op_domain")):
            if seen.seen(slot) and kind not in kinds:
                out.append(Finding(kind, [registry.CHECK_BY_KIND[kind].placeholder], {}, seen.rank(slot)))
        if not out and seen.seen(flags.NORMS):
            out.append(_norms_placeholder(self.norms, seen.rank(flags.NORMS)))
        return merge([out])

    def state_bad(self, loop: Loop, reader: Any) -> bool:
        return self.reading.flags.seen(flags.NORMS)  # the step's state is gone: its flag says

    def point_to_bad_micro_batch(self, loop: Loop, recorder: Any) -> None:
        """The micro-batches' records are gone: the window is named as a whole."""

    def marked(self, finding: Finding, read_at: int) -> Finding:
        """A finding of this step as its event says it: read late, at step ``read_at``; a value the forward or backward
        pass made while the step's kept totals say a buffer went non-finite during it (the weights, the optimizer
        state and the buffers it started from finite) says so (``buffer_written``): a write into a buffer, which the
        late read cannot name. Root causes only, and in one process only: the kept totals are each rank's own, and
        every rank must record the same events."""
        details = {**finding.details, "deferred": True, "read_at_step": read_at}
        root = "after" not in finding.details
        if finding.kind in _MADE and root and self.buffer_written:
            details["buffer_written"] = True
        return replace(finding, details=details)


#: The finding of each part of the ``NORMS`` slot read late: kind, what it names, site and details.
_NORM_PARTS: dict[str, tuple[str, str, str | None, dict[str, Any]]] = {
    "grads": ("nonfinite_grad", registry.CHECK_BY_KIND["nonfinite_grad"].placeholder, None, {}),
    "live_buffers": ("nonfinite_param", "a buffer", "buffer", {"when": AFTER_FORWARD}),
    "start_buffers": ("nonfinite_param", "a buffer", "buffer", {}),
    "params": ("nonfinite_param", "a parameter", "param", {}),
    "opt_state": ("nonfinite_param", "the optimizer state", "optimizer_state", {}),
}


#: the kinds whose value the forward or backward pass made (a buffer written during the step may be their source)
_MADE = ("nonfinite_output", "nonfinite_loss", "nonfinite_grad")


def _written_during(norms: tuple[list[str], torch.Tensor] | None) -> bool:
    """Whether the kept totals of a step say that a buffer went non-finite during it, the rest of the state finite
    (a host read, after a hit only)."""
    if norms is None:
        return False
    names, totals = norms
    bad = {n for n, v in zip(names, totals.reshape(-1).tolist()) if not math.isfinite(v)}
    return "live_buffers" in bad and not bad & {"start_buffers", "params", "opt_state"}


def _norms_placeholder(norms: tuple[list[str], torch.Tensor] | None, rank: int) -> Finding:
    """The first part of the ``NORMS`` slot whose kept total is non-finite (a host read, after a hit only)."""
    part = "grads"
    if norms is not None:
        names, totals = norms
        bad = [n for n, v in zip(names, totals.reshape(-1).tolist()) if not math.isfinite(v)]
        part = bad[0] if bad and bad[0] in _NORM_PARTS else part
    kind, where, site, details = _NORM_PARTS[part]
    return Finding(kind, [where], dict(details), rank, site=site)


class DeviceSkip:
    """The device-side skip of the deferred read: a flagged step's optimizer step made a no-op on the device, the
    buffers its forward pass changed put back there, and the LR schedule kept to put back a step skipped late."""

    def __init__(self) -> None:
        self._armed: list[torch.optim.Optimizer] = []  # optimizers whose next step may be skipped
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live buffer, its start copy)
        self._schedules: dict[int, tuple[list[dict[str, Any]], list[list[float]]]] = {}  # per step

    def start(self, loop: Loop, start: dict[str, torch.Tensor]) -> None:
        """Fit start: the buffers whose start-of-step copies a skip puts back."""
        self._buffers = [(b, start[n]) for n, b in loop.module.named_buffers() if n in start]

    def arm(self, loop: Loop, step: int, optimizer: Any, bad: torch.Tensor) -> None:
        """Make the coming optimizer step a no-op where ``bad`` (0-d, on the device); put back the buffers the bad
        forward pass changed with ``torch.where``; keep the LR schedule to put back a late skip (no sync)."""
        arm_device_skip(optimizer, bad)
        self._armed.append(optimizer)
        for live, start in self._buffers:
            live.copy_(torch.where(bad, start, live))
        schedulers = loop.schedulers
        if schedulers:  # host-side and tiny
            lrs = [[g["lr"] for g in o.param_groups] for o in loop.optimizers]
            self._schedules[step] = ([s.state_dict() for s in schedulers], lrs)

    def in_flight(self, optimizer: Any, device: torch.device) -> None:
        """The step in flight started from a state a late rollback replaces: skipped on the device too."""
        arm_device_skip(optimizer, torch.ones((), device=device))
        if optimizer not in self._armed:
            self._armed.append(optimizer)

    def disarm(self) -> None:
        """Remove ``found_inf`` once the optimizer has used it."""
        for optimizer in self._armed:
            disarm_device_skip(optimizer)
        self._armed.clear()

    def schedule_back(self, loop: Loop, step: int, skipped: bool) -> None:
        """Step ``step`` was read: when it was skipped for what it held, the LR schedule goes back to how that
        step found it (not after a forced skip: after a late rollback, the snapshot's schedule stands)."""
        schedule = self._schedules.pop(step, None)
        for old in [s for s in self._schedules if s < step]:
            del self._schedules[old]
        if not skipped or schedule is None:
            return
        for scheduler, state in zip(loop.schedulers, schedule[0]):
            scheduler.load_state_dict(state)
        for opt, lrs in zip(loop.optimizers, schedule[1]):
            for param_group, lr in zip(opt.param_groups, lrs):
                param_group["lr"] = lr


class Candidates:
    """The deferred read's snapshot candidates: the state at the start of a due step, captured then and made the
    verified snapshot once that step's flags read clean, dropped when they read bad (:class:`LateSnapshots`)."""

    def __init__(self, snapshots: Snapshots) -> None:
        self.snapshots = snapshots
        self.late: LateSnapshots[Snapshot] = LateSnapshots()

    def start(self) -> None:
        """Fit start: the fit-start snapshot is the first verified one."""
        first = self.snapshots.snapshot
        if first is not None:
            self.late.add(first.step, first)
            self.late.verified(first.step)

    def add(self, loop: Loop, rec: StepRecord) -> None:
        """Capture the state at ``rec``'s start (into the spare snapshot's storage; no collective)."""
        self.late.add(rec.step, self.snapshots.candidate(loop, rec))

    def judged(self, step: int, decision: Decision) -> None:
        """Step ``step`` read: a clean step verifies the candidates up to it; a bad one drops those taken at or
        after it (they hold its damage)."""
        if decision.keep_start:
            before = self.late.last
            self.late.verified(step)
            last = self.late.last
            if last is not None and last is not before:  # what checkpoints, a rollback and a halt fall back to
                self.snapshots.promote(last[1], spare=before[1] if before is not None else None)
        elif decision.drop_start:
            self.late.discard_from(step)

    @property
    def view(self) -> LateCandidates:
        """The candidates not verified yet and the last verified one (read-only)."""
        return LateCandidates(tuple(self.late.candidates), self.late.last)


class Deferred(ReadSchedule):
    """The deferred read schedule of one fit: flags pushed without blocking, read and judged one step late."""

    def __init__(self, pipeline: StepPipeline) -> None:
        super().__init__(pipeline)
        self.pending = PendingFlags()
        self.records: dict[int, StepRecord] = {}
        # per step: the watch's and op guard's records, and the NORMS slot's totals by part
        self.kept: dict[int, tuple[Any, list[Any], Any]] = {}
        self.carry: StepRecord | None = None  # a late decision, carried out at the end of the batch in flight
        self.skip = DeviceSkip()
        self.candidates = Candidates(pipeline.snapshots)

    @property
    def late_candidates(self) -> LateCandidates:
        return self.candidates.view

    def at_train_start(self, loop: Loop) -> None:
        """Refuse what a device-side skip cannot serve; the fit-start state becomes the first verified snapshot."""
        if loop.scaler is not None:
            raise NumGuardConfigError(
                "`sync_mode='deferred'` cannot be used with fp16 AMP: the GradScaler owns `found_inf`; "
                "use precision='bf16-mixed' or sync_mode='every_step'"
            )
        if not loop.automatic or len(loop.optimizers) != 1:
            raise NumGuardConfigError(
                "`sync_mode='deferred'` needs automatic optimization with one optimizer; use sync_mode='every_step'"
            )
        optimizer = loop.optimizers[0]
        if self.pipeline.settings.acting and not supports_device_skip(optimizer):
            raise NumGuardConfigError(
                f"`sync_mode='deferred'` skips a bad step on the device through `found_inf`, which "
                f"{type(optimizer).__name__} ignores unless it is fused: create it with `fused=True` "
                f"(e.g. torch.optim.AdamW(params, fused=True)), or use sync_mode='every_step'"
            )
        self.skip.start(loop, self.pipeline.reader.start_buffer_map)
        self.candidates.start()

    def at_optimizer_step(self, loop: Loop, optimizer: Any) -> None:
        """Pack and reduce the flags, arm the device skip, push the flags, judge the previous step's."""
        p = self.pipeline
        rec = p.recorder.record
        assert rec is not None
        due = p.due(loop.step)
        packed = p.reader.pack(loop, optimizer, due)
        n = p.reader.extras_at
        if p.settings.acting:
            bad = packed.narrow(0, 0, p.reader.acting_flags).any()  # an advisory check's flag comes after these
            if p.spike.acting and packed.numel() > n:  # a spike is skipped on the device too
                bad = bad | p.spike.device_flag(packed[n:])
            if rec.skip_forced:
                bad = torch.ones((), dtype=torch.bool, device=packed.device)
            self.skip.arm(loop, rec.step, optimizer, bad)
        self.records[rec.step] = rec
        self.kept[rec.step] = (*p.recorder.keep(), p.reader.norm_parts)
        late = self.pending.push(packed, rec.step)
        restored = late is not None and self._late(loop, *late, optimizer=optimizer)
        if due and not restored:  # the state at this step's start, verified when this step's flags read clean
            self.candidates.add(loop, rec)

    def after_step(self, loop: Loop) -> None:
        """Batch end: remove ``found_inf``; carry out a late decision taken during this batch."""
        self.skip.disarm()
        carry, self.carry = self.carry, None
        if carry is not None:
            self.pipeline.finish(loop, carry)

    def at_train_end(self, loop: Loop) -> None:
        """Read what is still pending (the last step's flags): one read per fit."""
        late = self.pending.pop()
        if late is not None:
            self._late(loop, *late, optimizer=None)
        self.after_step(loop)

    def _late(self, loop: Loop, step: int, values: list[float], optimizer: Any) -> bool:
        """Step ``step``'s flags, read one step late, through the pipeline. Returns whether a restore is due."""
        rec = self.records.pop(step, None)
        kept = self.kept.pop(step, (None, [], None))
        for table in (self.records, self.kept):
            for old in [s for s in table if s < step]:
                del table[old]
        if rec is None:
            return False
        p = self.pipeline
        n = p.reader.extras_at
        reading = Reading(flags.decode(values[:n], loop.world_size), {}, values[n:])
        forced = rec.skip_forced or reading.flags.seen(flags.QUARANTINE)
        decision = p.judge(
            loop, LateView(rec, reading, kept[0], kept[1], kept[2], world_size=loop.world_size), due=False
        )
        self.candidates.judged(step, decision)
        self.skip.schedule_back(loop, step, decision.skips and not forced)
        if decision.restore and optimizer is not None:  # the step in flight started from the state to replace
            self.skip.in_flight(optimizer, loop.device)
            p.recorder.force_skip("it started from the state a late rollback replaced")
        if decision.action != "none" or rec.events:
            self.carry = rec
        if optimizer is None:  # the end of the fit: carried out now
            self.after_step(loop)
        return decision.restore
