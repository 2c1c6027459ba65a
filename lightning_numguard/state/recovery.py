"""Recovery: the one part that changes training state, carrying out each step's judged ``Decision``.

It drops a bad step's gradients (or skips it on the device), puts back what a skipped forward pass changed,
restores the last verified-finite snapshot (:class:`~lightning_numguard.state.snapshots.Snapshots`), backs
the learning rate off, retries, quarantines, halts and writes ``last_finite.ckpt``, and swaps non-finite state
out of any checkpoint written during the run. It counts nothing (``callbacks/state/_ledger`` does).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from lightning_numguard.decide.judge import Decision
from lightning_numguard.decide.repeats import Restores, learning_rate, put_schedule, schedule
from lightning_numguard.detect import checks
from lightning_numguard.dtensor import local
from lightning_numguard.engine import group as _distributed
from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.read import StepRead
from lightning_numguard.engine.record import StepRecord
from lightning_numguard.state import gather as _sharded
from lightning_numguard.state.files import remove, replace
from lightning_numguard.state.outcome import Outcome
from lightning_numguard.state.quarantine import Quarantine, sample_indices
from lightning_numguard.state.retry import is_transient
from lightning_numguard.state.snapshot import Stateful
from lightning_numguard.state.snapshots import Snapshots
from lightning_numguard.state.stateful import apply_lr_backoff
from lightning_numguard.tree import clone_tree, tensors, to_plain

__all__ = ["Recovery"]

log = logging.getLogger(__name__)


class Recovery:
    """Carries out decisions on the training state: skip, rollback, retry, quarantine, halt, checkpoints.

    Args:
        dirpath: where ``last_finite.ckpt`` and ``bad_batches/`` go; ``None``: no file is written
            (``fast_dev_run``, or nowhere chosen to write to), the restored state lives on in memory.
        snapshots: the verified-finite snapshots.
        skip_batches_after_rollback: batches skipped after each rollback.
        lr_backoff: factor applied to every learning rate after each rollback.
        retry_transient: re-run the batch once after a rollback, to tell transient from persistent.
        quarantine: quarantine batches that fail twice (or fail their retry).
    """

    def __init__(
        self,
        dirpath: Path | None,
        snapshots: Snapshots,
        skip_batches_after_rollback: int,
        lr_backoff: float,
        retry_transient: bool,
        quarantine: bool,
    ) -> None:
        self.dirpath = dirpath
        self.snapshots = snapshots
        self.skip_batches_after_rollback = skip_batches_after_rollback
        self.lr_backoff = lr_backoff
        self.retry_transient = retry_transient
        self.use_quarantine = quarantine
        self.quarantine = Quarantine()
        self.skip_remaining = 0
        self.bad_rank = -1  # the lowest rank whose state the last checkpoint swap or end-of-fit check found bad
        self.restores = Restores()  # the updates each restore discards, and the rollbacks that repeat

    @property
    def snapshot(self) -> Any:
        """The last verified-finite snapshot (``None`` before the first)."""
        return self.snapshots.snapshot

    @property
    def stateful(self) -> dict[str, Stateful]:
        return self.snapshots.stateful

    @property
    def ckpt_path(self) -> Path | None:
        """``<dirpath>/last_finite.ckpt``, or ``None`` when no file is written."""
        return self.dirpath / "last_finite.ckpt" if self.dirpath is not None else None

    # ------------------------------------------------------------------ fit start and end

    def at_train_start(self, loop: Loop, reader: StepRead, take: bool) -> list[str]:
        """Check the whole state once (one sync per fit); if finite and ``take``, snapshot it.

        Returns the names found non-finite on any rank (buffers non-finite by design are left unchecked).
        """
        named = reader.state(loop, with_optimizer=True)
        bad = [n for (n, _), b in zip(named, checks.confirm_nonfinite([t for _, t in named])) if b]
        bad = reader.leave_unchecked(_distributed.any_rank(loop, bad))
        self.snapshots.resolve_async(loop)
        if not bad and take:
            self.snapshots.take(loop)
        return bad

    def at_train_end(
        self, loop: Loop, reader: StepRead, warn_only: bool
    ) -> tuple[list[str], str, dict[str, Any]] | None:
        """Check the last step's update once (one sync per fit); repair what is bad unless ``warn_only``.

        Returns ``None`` when all is finite, else the bad names, the action taken and the event's details
        (:attr:`bad_rank` is then the lowest rank where they were non-finite: one rank's shard, under sharding).
        """
        named = reader.state(loop, with_optimizer=False)
        flags = checks.confirm_nonfinite([t for _, t in named])
        bad, self.bad_rank = _distributed.first_rank(loop, [n for (n, _), b in zip(named, flags) if b])
        if not bad:
            return None
        if warn_only or self.snapshot is None:
            return bad, "none", {"when": "end of training"}
        return bad, "rollback", self.repair_at_end(loop, bad)

    def repair_at_end(self, loop: Loop, bad: list[str]) -> dict[str, Any]:
        """End of fit: put back only ``bad`` tensors that took no part in training, else the whole snapshot.

        A parameter without a gradient (frozen, or unused by the loss) cannot have changed the other
        tensors: restoring it alone from the snapshot keeps every step of the run. Anything else is a full
        rollback, and the details say how many steps it gives up. Returns the event's details.
        """
        assert self.snapshot is not None
        params = dict(loop.module.named_parameters())
        snapshot = self.snapshots.full(loop)
        idle = [n for n in bad if n in params and params[n].grad is None and n in snapshot.model]
        if len(idle) == len(bad):
            with torch.no_grad():
                for name in idle:
                    target = local(params[name])  # a DTensor: its local shard, which the snapshot holds
                    target.copy_(snapshot.model[name].to(target.device))
            log.warning(
                "numguard restored only %s from the snapshot of step %s at the end of training: they took no part "
                "in training (no gradient), so no training step is given up",
                idle,
                self.snapshot.step,
            )
            when = "at the end of training (restored alone from the snapshot: unused by training, no step given up)"
            return {"when": when, "restored_only": idle, "steps_given_up": 0}
        lost = max(loop.step - self.snapshot.step, 0)
        self.snapshots.restore(loop, restore_rng=False)
        log.warning(
            "numguard rolled the whole model back to the snapshot of step %s at the end of training: %s training "
            "step(s) are given up (take snapshots more often with snapshot_every_n_steps to lose fewer)",
            self.snapshot.step,
            lost,
        )
        when = (
            f"at the end of training (rolled back to the snapshot of step {self.snapshot.step}: {lost} steps given up)"
        )
        return {"when": when, "snapshot_step": self.snapshot.step, "steps_given_up": lost}

    # ------------------------------------------------------------------ the step

    def flag_batch(
        self, rec: StepRecord, batch: Any, batch_idx: int, loop: Loop, first: bool
    ) -> tuple[str | None, torch.Tensor | None]:
        """Why the batches of the window after a rollback are skipped; the quarantine flag of a micro-batch for the
        read (0-d, on the device, no sync). Returns ``(skip reason, flag)``, each ``None`` when there is none."""
        if rec.skip_forced:
            return None, None
        if first and self.skip_remaining > 0:
            self.skip_remaining -= 1
            return "in the skip window after a rollback", None
        if self.use_quarantine and self.quarantine.entries:  # (no entry: no flag, and no step to read)
            return None, self.quarantine.flag(batch, batch_idx, loop.step)
        return None, None

    def at_read(self, loop: Loop, rec: StepRecord, decision: Decision, optimizer: Any) -> None:
        """Read at the step, before its optimizer step: drop the gradients of a skipped step; keep a verified start."""
        if decision.skips and optimizer is not None:
            self.drop_gradients(optimizer)
        if decision.keep_start:
            self.snapshots.take(loop, rec)

    @staticmethod
    def drop_gradients(optimizer: Any) -> None:
        """A skipped step's optimizer step becomes a no-op: no momentum, weight decay or step count moves."""
        optimizer.zero_grad(set_to_none=True)

    def carry_out(self, loop: Loop, rec: StepRecord) -> Outcome:
        """Batch end: what the decision leaves to be done once the optimizer step is over. Returns what was done
        (the ledger records the step's events with it). A step the device already skipped (``decision.on_device``,
        read late) has nothing of its forward pass to undo, and no batch at hand to retry."""
        decision = rec.decision
        assert decision is not None
        on_device = decision.on_device
        restore, lrs, retry, quarantined = None, None, None, False
        if decision.skips and not on_device:  # what the discarded step logged must not reach monitors or loggers
            loop.discard_logged()
        if decision.action == "skip":
            if not on_device:  # the device put the buffers back itself
                self.undo_forward(loop, rec)
            if decision.quarantine:
                quarantined = self.quarantine_batch(loop, rec, decision.quarantine)
        elif decision.action == "rollback":
            restore = self.restores.before(loop, rec, self.snapshot, decision.new_rollback, decision.place)
            kept = schedule(loop) if restore is not None and restore.repeat is not None else None
            self.snapshots.restore(loop)  # collective when sharded: every rank read the same flags
            put_schedule(loop, kept)  # a repeat: the LR schedule keeps its place, the same steps are not run again
            self.restores.repeats.restored(learning_rate(loop))
            if decision.new_rollback:
                lrs = self.after_rollback(loop)
                if self.retry_transient and not on_device:
                    retry, quarantined = self._retry(loop, rec)
                    put_schedule(loop, kept)
                elif decision.quarantine:
                    quarantined = self.quarantine_batch(loop, rec, decision.quarantine)
                self.save_last_finite(loop)
        elif decision.action == "halt":
            restore = self.restores.before(loop, rec, self.snapshot, False)
            self.halt(loop)
        if decision.skips:
            self.restores.skipped.add(rec.step)
        now = self.snapshot.step if self.snapshot is not None else None
        return Outcome(decision.action, restore, now, lrs, retry, quarantined)

    # ------------------------------------------------------------------ actions

    def undo_forward(self, loop: Loop, rec: StepRecord) -> None:
        """``skip``: put back the buffers and metric states the bad forward pass changed."""
        if rec.start_buffers:
            loop.module.load_state_dict(rec.start_buffers, strict=False)
        for name, state in (rec.start_states or {}).items():
            if name.startswith("metric:"):
                self.stateful[name].load_state_dict(clone_tree(state))

    def after_rollback(self, loop: Loop) -> list[float] | None:
        """A new rollback's skip window and learning-rate back-off; returns the learning rates after the back-off
        (``None``: none applied)."""
        self.skip_remaining = self.skip_batches_after_rollback
        if self.lr_backoff == 1.0:
            return None
        schedulers = loop.schedulers
        return apply_lr_backoff(loop.optimizers, schedulers, self.lr_backoff)

    def _retry(self, loop: Loop, rec: StepRecord) -> tuple[str, bool]:
        """Decide whether the incident was transient: re-run the batch once from the restored state.

        The re-run trains nothing (see :mod:`~lightning_numguard.state.retry`) and the snapshot is put back
        after it. A transient batch is simply not trained on; a persistent one is quarantined at once. Returns what
        the re-run said and whether the batch was quarantined.
        """
        ok = is_transient(loop, rec.batch, rec.batch_idx, rec.start_rng)
        ok = not _distributed.any_rank(loop, [] if ok else ["retry"])
        said = "transient: finite on retry" if ok else "persistent: non-finite again"
        self.snapshots.restore(loop)
        if not ok and self.use_quarantine:
            return said, self.quarantine_batch(loop, rec, "non-finite again when re-run from the last finite state")
        return said, False

    def quarantine_batch(self, loop: Loop, rec: StepRecord, reason: str) -> bool:
        """Quarantine ``rec``'s batch, saving it under ``bad_batches/`` (rank 0). Returns whether it was (not when
        it already is)."""
        if self.quarantine.holds(rec.batch_idx):
            return False
        entry: dict[str, Any] = {
            "epoch": rec.epoch,
            "batch_idx": rec.batch_idx,
            "step": rec.step,
            "reason": reason,
            "sample_indices": sample_indices(rec.batch),
        }
        if loop.is_zero and self.dirpath is not None:
            folder = self.dirpath / "bad_batches"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"epoch{rec.epoch}_batch{rec.batch_idx}_step{rec.step}.pt"
            torch.save({**entry, "batch": to_plain(rec.batch)}, path)
            entry["file"] = str(path)
        self.quarantine.add(entry)
        return True

    def halt(self, loop: Loop) -> None:
        """Restore the last finite state, save it, and ask every rank to stop."""
        if self.snapshot is not None:
            self.snapshots.restore(loop)
            self.save_last_finite(loop)
        loop.stop()

    def save_last_finite(self, loop: Loop) -> None:
        """Write the (restored, finite) live state as the loop's own checkpoint, atomically.

        A loop whose state is local shards (``ModelParallelStrategy``) writes a folder: it is written under a
        temporary name too, then put in place of the previous one by rank 0; every rank waits for it at a barrier.
        """
        final = self.ckpt_path
        if final is None:
            return
        tmp = final.with_name(final.name + ".tmp")
        if loop.is_zero:
            final.parent.mkdir(parents=True, exist_ok=True)
            remove(tmp)  # a folder left by an interrupted save would mix old shards with new ones
        loop.save_checkpoint(tmp)  # collective: every rank calls it (after rank 0 cleared tmp)
        if loop.is_zero:
            replace(tmp, final)
        if loop.world_size > 1:  # every rank then finds the file in place (its halt message says where it is)
            loop.barrier("numguard_last_finite")

    def swap_checkpoint(self, loop: Loop, checkpoint: dict[str, Any], unchecked: set[str]) -> bool:
        """Replace a checkpoint's non-finite model and optimizer states by the snapshot's (collective).

        Returns whether it did (then :attr:`bad_rank` is the lowest rank whose checkpoint state was non-finite).
        Costs one sync per checkpoint, nothing per step.
        """
        if self.snapshot is None:
            return False
        model_state = {k: v for k, v in checkpoint.get("state_dict", {}).items() if k not in unchecked}
        found = tensors(model_state) + tensors(checkpoint.get("optimizer_states", []))
        if self.snapshot.specs:  # DTensor local shards: a checkpoint may hold this rank's shards, or nothing here
            bad = bool(found) and any(checks.confirm_nonfinite(found))
            self.bad_rank = _distributed.first_rank(loop, ["bad"] if bad else [])[1]  # every rank calls it
            if self.bad_rank < 0:
                return False
            _sharded.swap_local_shards(loop, self.snapshot.ready(), checkpoint)
            return True
        if not found:
            return False
        self.bad_rank = _distributed.first_rank(loop, ["bad"] if any(checks.confirm_nonfinite(found)) else [])[1]
        if self.bad_rank < 0:
            return False
        snapshot = self.snapshots.full(loop)
        checkpoint["state_dict"] = clone_tree(snapshot.model, "cpu")
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = clone_tree(snapshot.optimizers, "cpu")
        return True
