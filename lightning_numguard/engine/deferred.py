"""``NumGuardCallback(sync_mode="deferred")``: the read schedule with no host read on the step it checks.

The step's flag vector is packed and all-reduced on the device exactly as in the default mode
(:meth:`StepRead.pack <lightning_numguard.engine.read.StepRead.pack>`), then

* the optimizer step is skipped **on the device** when any flag is set (``Recovery.skip_on_device``:
  ``found_inf`` armed on the fused optimizer, as ``torch.amp.GradScaler`` does, and the buffers the bad
  forward pass changed put back with ``torch.where``);
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

from typing import Any

import torch

from lightning_numguard.detect import flags
from lightning_numguard.diagnose.builder import StepView
from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.pending import PendingFlags, supports_device_skip
from lightning_numguard.engine.pipeline import StepPipeline
from lightning_numguard.engine.read import Reading
from lightning_numguard.engine.record import StepRecord
from lightning_numguard.engine.schedule import ReadSchedule
from lightning_numguard.errors import NumGuardConfigError

__all__ = ["Deferred"]


class Deferred(ReadSchedule):
    """The deferred read schedule of one fit: flags pushed without blocking, read and judged one step late."""

    def __init__(self, pipeline: StepPipeline) -> None:
        super().__init__(pipeline)
        self.pending = PendingFlags()
        self.records: dict[int, StepRecord] = {}
        # per step: the watch's and op guard's records, and the NORMS slot's totals by part
        self.kept: dict[int, tuple[Any, list[Any], Any]] = {}
        self.carry: StepRecord | None = None  # a late decision, carried out at the end of the batch in flight

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
        self.pipeline.recovery.start_late(loop, self.pipeline.reader.start_buffer_map)

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
            p.recovery.skip_on_device(loop, rec.step, optimizer, bad)
        self.records[rec.step] = rec
        self.kept[rec.step] = (*p.recorder.keep(), p.reader.norm_parts)
        late = self.pending.push(packed, rec.step)
        restored = late is not None and self._late(loop, *late, optimizer=optimizer)
        if due and not restored:  # the state at this step's start, verified when this step's flags read clean
            p.snapshots.add_candidate(loop, rec)

    def after_step(self, loop: Loop) -> None:
        """Batch end: remove ``found_inf``; carry out a late decision taken during this batch."""
        self.pipeline.recovery.disarm()
        carry, self.carry = self.carry, None
        if carry is not None:
            self.pipeline.finish(loop, carry, late=True)

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
        decision = p.judge(loop, StepView(rec, reading, kept[:2], norms=kept[2]), due=False)
        p.recovery.at_late_read(loop, step, decision, forced)
        if decision.restore and optimizer is not None:  # the step in flight started from the state to replace
            p.recovery.skip_in_flight(optimizer, loop.device)
            p.recorder.force_skip("it started from the state a late rollback replaced")
        if decision.action != "none" or rec.events:
            self.carry = rec
        if optimizer is None:  # the end of the fit: carried out now
            self.after_step(loop)
        return decision.restore
