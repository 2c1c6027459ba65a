"""Recovery: snapshots, skip, rollback, retry, halt, ``last_finite.ckpt`` and the checkpoint swap."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_numguard.callbacks import _distributed, _micro, _sharded
from lightning_numguard.callbacks._inspector import StepInspector, StepRecord
from lightning_numguard.callbacks._retry import is_transient
from lightning_numguard.callbacks._strategies import holds_local_shards
from lightning_numguard.core import checks
from lightning_numguard.core.dtensor import local
from lightning_numguard.core.quarantine import Quarantine, position_key, sample_indices
from lightning_numguard.core.snapshot import (
    PendingCapture,
    Snapshot,
    Stateful,
    capture,
    finish_capture,
    restore,
    start_capture,
)
from lightning_numguard.core.stateful import MetricState, NumpyRNG, PrecisionState, apply_lr_backoff
from lightning_numguard.core.tree import clone_tree, tensors, to_plain

__all__ = ["Recovery", "stateful_objects"]

log = logging.getLogger(__name__)


def stateful_objects(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Stateful]:
    """Everything besides the module and optimizers that a bitwise rollback must restore."""
    out: dict[str, Stateful] = {}
    for i, config in enumerate(trainer.lr_scheduler_configs):
        out[f"lr_scheduler:{i}"] = config.scheduler
    plugin = trainer.precision_plugin
    if getattr(plugin, "scaler", None) is not None:
        out["precision"] = PrecisionState(plugin)
    from torchmetrics import Metric  # a dependency of Lightning

    for name, module in pl_module.named_modules():
        if isinstance(module, Metric):
            out[f"metric:{name}"] = MetricState(module)
    out["numpy_rng"] = NumpyRNG()
    return out


class Recovery:
    """Keeps the last verified-finite state and puts it back.

    Args:
        dirpath: where ``last_finite.ckpt`` and ``bad_batches/`` go; ``None``: no file is written
            (``fast_dev_run``, or nowhere chosen to write to), the restored state lives on in memory.
        snapshot_device: ``"host"`` or ``"device"``.
        skip_batches_after_rollback: batches skipped after each rollback.
        lr_backoff: factor applied to every learning rate after each rollback.
        retry_transient: re-run the batch once after a rollback, to tell transient from persistent.
        quarantine: quarantine batches that fail twice (or fail their retry).
        snapshot_sharding: ``"auto"``: under DDP with several ranks, each keeps only its ``1/world`` of the
            parameters and optimizer state, gathered back (collectively) to restore; ``"off"``: full copies.
        snapshot_async: copy the parameters and optimizer state of a snapshot step from its batch start on,
            overlapped with the forward and backward passes, into a spare snapshot (double buffering); the
            candidate is promoted at the read only if the state it copied is verified finite. ``None``: on
            when the module is on CUDA and snapshots go to the host (resolved at train start).
    """

    def __init__(
        self,
        dirpath: Path | None,
        snapshot_device: str,
        skip_batches_after_rollback: int,
        lr_backoff: float,
        retry_transient: bool,
        quarantine: bool,
        snapshot_sharding: str = "off",
        snapshot_async: bool | None = False,
    ) -> None:
        self.dirpath = dirpath
        self.snapshot_device = snapshot_device
        self.skip_batches_after_rollback = skip_batches_after_rollback
        self.lr_backoff = lr_backoff
        self.retry_transient = retry_transient
        self.use_quarantine = quarantine
        self.snapshot_sharding = snapshot_sharding
        self.quarantine = Quarantine()
        self.snapshot: Snapshot | None = None
        self.snapshot_async = snapshot_async
        self.async_on = False  # resolved at train start
        self.spare: Snapshot | None = None  # the storage the next asynchronous candidate is copied into
        self.pending: PendingCapture | None = None  # the candidate in flight (from batch start to the read)
        self.last_snapshot_step = -(10**9)
        self.stateful: dict[str, Stateful] = {}
        self.skip_remaining = 0
        self.rollbacks_this_fit = 0
        self.bad_rank = -1  # the lowest rank whose state the last checkpoint swap or end-of-fit check found bad

    @property
    def ckpt_path(self) -> Path | None:
        """``<dirpath>/last_finite.ckpt``, or ``None`` when no file is written."""
        return self.dirpath / "last_finite.ckpt" if self.dirpath is not None else None

    # ------------------------------------------------------------------ snapshots

    def start_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, due: bool) -> None:
        """Batch start of a step whose snapshot is ``due``: start copying into the spare (asynchronous only)."""
        if not due or self.pending is not None:
            return
        self.pending = start_capture(
            pl_module,
            trainer.optimizers,
            step=trainer.global_step,
            where="host" if self.snapshot_device == "host" else "device",
            reuse=self.spare,  # never the verified snapshot: it stays whole until the candidate is verified
            shard_among=_sharded.shard_among(trainer, self.snapshot_sharding),
            backend="stream" if pl_module.device.type == "cuda" else "thread",
        )

    def settle(self) -> None:
        """After the read: a candidate not promoted (the state it copied was not verified) is discarded."""
        if self.pending is not None:
            self.pending.copies.synchronize()  # nothing may overwrite its sources (a restore) before it is done
            self.pending = None

    def take(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: StepRecord | None = None) -> None:
        """Keep the state at the start of this step (just verified finite), or the live state without ``rec``."""
        pending = self.pending
        if pending is not None and rec is not None and pending.step == rec.step:
            candidate = finish_capture(
                pending,
                pl_module,
                trainer.optimizers,
                self.stateful,
                rng=rec.micro[0].rng if rec.micro else rec.start_rng,
                model_state=rec.start_buffers,
                stateful_state=rec.start_states,
            )
            pending.wait()  # the optimizer step, queued next, cannot overwrite a source before it is copied
            self.pending = None
            self.spare, self.snapshot = self.snapshot, candidate  # the old verified snapshot becomes the spare
            self.last_snapshot_step = candidate.step
            return
        self.settle()
        if self.snapshot is not None:
            self.snapshot.ready()  # an asynchronous snapshot's copies are done before its storage is reused
        self.snapshot = capture(
            pl_module,
            trainer.optimizers,
            self.stateful,
            step=rec.step if rec is not None else trainer.global_step,
            where="host" if self.snapshot_device == "host" else "device",
            rng=(rec.micro[0].rng if rec.micro else rec.start_rng) if rec is not None else None,  # window start
            model_state=rec.start_buffers if rec is not None else None,
            stateful_state=rec.start_states if rec is not None else None,
            reuse=self.snapshot,
            shard_among=_sharded.shard_among(trainer, self.snapshot_sharding),
        )
        self.last_snapshot_step = self.snapshot.step

    def at_train_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, inspector: StepInspector, take: bool
    ) -> list[str]:
        """Check the whole state once (one sync per fit); if finite and ``take``, snapshot it.

        Returns the names found non-finite on any rank (buffers non-finite by design are left unchecked).
        """
        named = inspector.state(trainer, with_optimizer=True)
        bad = [n for (n, _), b in zip(named, checks.confirm_nonfinite([t for _, t in named])) if b]
        bad = inspector.leave_unchecked(_distributed.any_rank(trainer, bad))
        auto = pl_module.device.type == "cuda" and self.snapshot_device == "host"
        self.async_on = auto if self.snapshot_async is None else self.snapshot_async
        if not bad and take:
            self.take(trainer, pl_module)
        return bad

    def at_train_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, inspector: StepInspector, warn_only: bool
    ) -> tuple[list[str], str, dict[str, Any]] | None:
        """Check the last step's update once (one sync per fit); repair what is bad unless ``warn_only``.

        Returns ``None`` when all is finite, else the bad names, the action taken and the event's details
        (:attr:`bad_rank` is then the lowest rank where they were non-finite: one rank's shard, under sharding).
        """
        named = inspector.state(trainer, with_optimizer=False)
        flags = checks.confirm_nonfinite([t for _, t in named])
        bad, self.bad_rank = _distributed.first_rank(trainer, [n for (n, _), b in zip(named, flags) if b])
        if not bad:
            return None
        if warn_only or self.snapshot is None:
            return bad, "none", {"when": "end of training"}
        return bad, "rollback", self.repair_at_end(trainer, pl_module, bad)

    def flag_batch(self, rec: StepRecord, batch: Any, batch_idx: int, step: int, first: bool) -> None:
        """Skip the batches of the window after a rollback; flag quarantined micro-batches for the read (no sync)."""
        if rec.forced_skip is not None:
            return
        if first and self.skip_remaining > 0:
            self.skip_remaining -= 1
            rec.forced_skip = "in the skip window after a rollback"
        elif self.use_quarantine:
            _micro.merge_flag(rec, self.quarantine.flag(batch, batch_idx, step))

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, restore_rng: bool = True) -> None:
        """Put the snapshot back in place."""
        assert self.snapshot is not None
        restore(self.full(trainer), pl_module, trainer.optimizers, self.stateful, restore_rng=restore_rng)

    def full(self, trainer: pl.Trainer) -> Snapshot:
        """The whole snapshot (gathered from every rank when sharded: then collective)."""
        assert self.snapshot is not None
        return _sharded.gather_snapshot(trainer, self.snapshot.ready())

    def repair_at_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, bad: list[str]) -> dict[str, Any]:
        """End of fit: put back only ``bad`` tensors that took no part in training, else the whole snapshot.

        A parameter without a gradient (frozen, or unused by the loss) cannot have changed the other
        tensors: restoring it alone from the snapshot keeps every step of the run. Anything else is a full
        rollback, and the details say how many steps it gives up. Returns the event's details.
        """
        assert self.snapshot is not None
        params = dict(pl_module.named_parameters())
        snapshot = self.full(trainer)
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
        lost = max(trainer.global_step - self.snapshot.step, 0)
        self.restore(trainer, pl_module, restore_rng=False)
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

    # ------------------------------------------------------------------ actions

    def undo_forward(self, pl_module: pl.LightningModule, rec: StepRecord) -> None:
        """``skip``: put back the buffers and metric states the bad forward pass changed."""
        if rec.start_buffers:
            pl_module.load_state_dict(rec.start_buffers, strict=False)
        for name, state in (rec.start_states or {}).items():
            if name.startswith("metric:"):
                self.stateful[name].load_state_dict(clone_tree(state))

    def rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: StepRecord) -> None:
        """Restore the snapshot; for a new incident (``rec.events``) also back off, retry or quarantine."""
        self.restore(trainer, pl_module)
        if not rec.events:  # a forced skip (skip window / quarantine): not a new rollback
            return
        self.after_rollback(trainer, rec.events)
        if self.retry_transient:
            self._retry(trainer, pl_module, rec)
        elif self.use_quarantine and self.quarantine.failures.get(position_key(rec.batch, rec.batch_idx), 0) >= 2:
            self.quarantine_batch(trainer, rec, "failed at the same position more than once")
        self.save_last_finite(trainer)

    def after_rollback(self, trainer: pl.Trainer, events: list[dict[str, Any]]) -> None:
        """A new rollback's bookkeeping: count it, open the skip window, back the LR off (said in ``events``)."""
        self.rollbacks_this_fit += 1
        self.skip_remaining = self.skip_batches_after_rollback
        if self.lr_backoff != 1.0:
            schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
            lrs = apply_lr_backoff(trainer.optimizers, schedulers, self.lr_backoff)
            for e in events:
                e["details"]["lr_after_backoff"] = lrs

    def _retry(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: StepRecord) -> None:
        """Decide whether the incident was transient: re-run the batch once from the restored state.

        The re-run trains nothing (see :mod:`~lightning_numguard.callbacks._retry`) and the snapshot is put back
        after it. A transient batch is simply not trained on; a persistent one is quarantined at once.
        """
        ok = is_transient(trainer, pl_module, rec.batch, rec.batch_idx, rec.start_rng)
        ok = not _distributed.any_rank(trainer, [] if ok else ["retry"])
        for e in rec.events:
            e["details"]["retry"] = "transient: finite on retry" if ok else "persistent: non-finite again"
        self.restore(trainer, pl_module)
        if not ok and self.use_quarantine:
            self.quarantine_batch(trainer, rec, "non-finite again when re-run from the last finite state")

    def quarantine_batch(self, trainer: pl.Trainer, rec: StepRecord, reason: str) -> None:
        """Quarantine ``rec``'s batch, saving it under ``bad_batches/`` (rank 0)."""
        if self.quarantine.holds(rec.batch_idx):
            return
        entry: dict[str, Any] = {
            "epoch": rec.epoch,
            "batch_idx": rec.batch_idx,
            "step": rec.step,
            "reason": reason,
            "sample_indices": sample_indices(rec.batch),
        }
        if trainer.is_global_zero and self.dirpath is not None:
            folder = self.dirpath / "bad_batches"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"epoch{rec.epoch}_batch{rec.batch_idx}_step{rec.step}.pt"
            torch.save({**entry, "batch": to_plain(rec.batch)}, path)
            entry["file"] = str(path)
        self.quarantine.add(entry)
        for e in rec.events:
            e["details"]["quarantined"] = True

    def halt(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Restore the last finite state, save it, and ask every rank to stop."""
        if self.snapshot is not None:
            self.restore(trainer, pl_module)
            self.save_last_finite(trainer)
        trainer.should_stop = True

    def save_last_finite(self, trainer: pl.Trainer) -> None:
        """Write the (restored, finite) live state as a normal Lightning checkpoint, atomically.

        A strategy that shards its checkpoint (``ModelParallelStrategy``) writes a folder: it is written under
        a temporary name too, then put in place of the previous one by rank 0 behind a barrier.
        """
        final = self.ckpt_path
        if final is None:
            return
        tmp = final.with_name(final.name + ".tmp")
        if trainer.is_global_zero:
            final.parent.mkdir(parents=True, exist_ok=True)
            _remove(tmp)  # a folder left by an interrupted save would mix old shards with new ones
        trainer.save_checkpoint(tmp, weights_only=False)  # collective: every rank calls it (after rank 0 cleared tmp)
        if trainer.is_global_zero:
            _replace(tmp, final)
        if trainer.world_size > 1 and holds_local_shards(trainer.strategy):  # a folder, written by every rank
            trainer.strategy.barrier("numguard_last_finite")

    def swap_checkpoint(self, trainer: pl.Trainer, checkpoint: dict[str, Any], unchecked: set[str]) -> bool:
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
            self.bad_rank = _distributed.first_rank(trainer, ["bad"] if bad else [])[1]  # every rank calls it
            if self.bad_rank < 0:
                return False
            _sharded.swap_local_shards(trainer, trainer.lightning_module, self.snapshot.ready(), checkpoint)
            return True
        if not found:
            return False
        self.bad_rank = _distributed.first_rank(trainer, ["bad"] if any(checks.confirm_nonfinite(found)) else [])[1]
        if self.bad_rank < 0:
            return False
        snapshot = self.full(trainer)
        checkpoint["state_dict"] = clone_tree(snapshot.model, "cpu")
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = clone_tree(snapshot.optimizers, "cpu")
        return True


def _remove(path: Path) -> None:
    """Delete a file or a folder, if there is one."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _replace(tmp: Path, final: Path) -> None:
    """Put ``tmp`` (a file or a folder) in place of ``final``: a file atomically; a folder by two renames, so
    that at every moment a whole checkpoint exists under ``final`` or under ``final.old``."""
    if not tmp.is_dir() and not final.is_dir():
        os.replace(tmp, final)
        return
    old = final.with_name(final.name + ".old")
    _remove(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _remove(old)
