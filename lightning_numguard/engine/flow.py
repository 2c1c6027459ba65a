"""The step's flow, written once: what each Lightning hook does, for both read schedules.

``NumGuardCallback``'s hooks are one-line delegations to :class:`StepFlow` (as Lightning's ``SpikeDetection``
delegates to Fabric's utility). The flow wires a fit's parts once (:meth:`StepFlow.setup`) and runs them in the
step's order; the one part that differs between ``sync_mode`` values is the read schedule
(:class:`~lightning_numguard.engine.schedule.ReadSchedule`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_numguard import _compat
from lightning_numguard.detect.coverage_check import CoverageCheck
from lightning_numguard.detect.spike_guard import STATEFUL_KEY
from lightning_numguard.doors.trainer import nofiles as _nofiles
from lightning_numguard.doors.trainer.strategies import check_strategy
from lightning_numguard.engine.deferred import Deferred
from lightning_numguard.engine.pipeline import Settings, StepPipeline
from lightning_numguard.engine.schedule import EveryStep, ReadSchedule
from lightning_numguard.reporting.progress import FitProgress
from lightning_numguard.reporting.series import RunSeries
from lightning_numguard.state.snapshots import stateful_objects

__all__ = ["StepFlow", "read_schedule"]


def read_schedule(pipeline: StepPipeline) -> ReadSchedule:
    """The read schedule ``pipeline.settings.sync_mode`` names."""
    return Deferred(pipeline) if pipeline.settings.sync_mode == "deferred" else EveryStep(pipeline)


class StepFlow:
    """The parts of one fit and the order the hooks run them in."""

    def __init__(self, settings: Settings, dirpath: Path | None = None) -> None:
        """New parts for a fit (``dirpath``: where files go; ``None``: no file is written)."""
        self.settings = settings
        self.pipeline = StepPipeline.build(settings, dirpath)
        self.coverage = CoverageCheck(settings.check_optimizer_coverage)
        self.progress = FitProgress()
        sigma = settings.spike_sigma if self.pipeline.spike.window is not None else None
        self.series = RunSeries(self.pipeline.reporter, sigma)
        self.schedule = read_schedule(self.pipeline)

    def __getstate__(self) -> dict[str, Any]:
        # Hooks, the op-guard mode and the step record belong to a running fit; setup rebuilds them.
        state = self.__dict__.copy()
        state["pipeline"] = self.pipeline.without_instruments()
        state["schedule"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.schedule = read_schedule(self.pipeline)

    # ------------------------------------------------------------------ once per fit

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str, settings: Settings) -> StepFlow:
        """The flow of this fit: new parts, the model's hooks attached (``self`` for any other stage)."""
        if stage != "fit":
            return self
        self.pipeline.recorder.detach()
        _compat.require_accumulation_api(trainer)
        check_strategy(trainer.strategy, settings.action)
        root = Path(trainer.log_dir or trainer.default_root_dir)
        dirpath = Path(settings.dirpath) if settings.dirpath else root / "numguard"
        flow = StepFlow(settings, dirpath if _nofiles.writes_files(trainer, settings.dirpath) else None)
        flow.pipeline.recorder.attach(pl_module)
        return flow

    def at_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        p = self.pipeline
        stateful = stateful_objects(trainer, pl_module)
        if p.spike.window is not None:  # snapshots hold the spike window: a rollback puts it back
            stateful[STATEFUL_KEY] = p.spike.window
        p.snapshots.track(stateful)
        p.reader.resolve(pl_module, stateful)
        self.coverage.at_fit_start(trainer, pl_module, p.ledger)
        p.announce_spikes(trainer)

    def at_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning restored optimizers, schedulers and the scaler from a checkpoint (it does so after
        # on_fit_start): a snapshot taken earlier would roll a resumed run back to fresh optimizers.
        p = self.pipeline
        bad = p.recovery.at_train_start(trainer, pl_module, p.reader, self.settings.acting)
        # the fused check writes the same bits back: only while no snapshot is copied on another thread
        p.reader.allow_rewrite(not p.snapshots.async_on)
        if bad:
            p.halt_at_fit_start(trainer, bad)
        self.schedule.at_train_start(trainer, pl_module)

    def at_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.schedule.at_train_end(trainer, pl_module)
        self.pipeline.at_train_end(trainer, pl_module)  # the last step's update: checked once (one sync per fit)

    def at_save_checkpoint(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """Last line of defence: no checkpoint written during the run holds non-finite weights (see
        :meth:`StepPipeline.swap_checkpoint
        <lightning_numguard.engine.pipeline.StepPipeline.swap_checkpoint>`)."""
        if self.settings.acting:
            self.pipeline.swap_checkpoint(trainer, checkpoint)

    def at_end(self, trainer: pl.Trainer, fit: bool, exception: BaseException | None = None) -> None:
        """``teardown`` or ``on_exception``: a fit's last series and summary (how it ended); hooks off."""
        if fit:
            ended = type(exception).__name__ if exception is not None else "finished"
            events, counters = self.pipeline.ledger.events, self.pipeline.ledger.counters
            self.series.at_end(trainer, events, ended)
            self.progress.report(trainer, events, counters, self.events_path(), ended)
        self.close()

    # ------------------------------------------------------------------ every step

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        p = self.pipeline
        new_step = p.recorder.record is None
        acting = self.settings.acting
        rec = p.recorder.begin(trainer, pl_module, batch, batch_idx, acting, p.snapshots.stateful)
        skip, flag = p.recovery.flag_batch(rec, batch, batch_idx, trainer.global_step, new_step)
        if skip is not None:
            p.recorder.force_skip(skip)
        p.recorder.flag_quarantine(flag)
        if new_step and p.snapshots.async_on:  # start the due snapshot's copies, overlapped with the step
            p.snapshots.start(trainer, pl_module, p.due(trainer.global_step))
        if new_step and acting:
            p.recovery.logged.mark(trainer)
        p.recorder.enter_ops()

    def before_backward(self, loss: torch.Tensor) -> None:
        self.pipeline.recorder.exit_ops()
        self.pipeline.recorder.record_loss(loss)

    def before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        recorder = self.pipeline.recorder
        recorder.exit_ops()
        rec = recorder.record
        if rec is None:  # an optimizer step outside a training batch (manual loops)
            return
        if rec.read_done and rec.bad:  # a further optimizer of a bad batch (manual optimization)
            self.pipeline.recovery.drop_gradients(optimizer)
            return
        if rec.read_done:  # a further optimizer of a clean batch: its gradients only
            recorder.forget_forward()
        if not rec.skip_forced:  # both read schedules: the gradients are known here, read or not
            self.coverage.at_first_step(trainer, pl_module, optimizer, self.pipeline.ledger)
        recorder.at_optimizer_step(optimizer)
        self.schedule.at_optimizer_step(trainer, pl_module, optimizer)

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        p = self.pipeline
        p.recorder.exit_ops()
        rec = p.recorder.record
        if rec is None:
            return
        if not rec.read_done:
            if _compat.should_accumulate(trainer):
                return  # the window's records are read at its optimizer step
            p.read(trainer, pl_module, None)  # a batch without an optimizer step is read at its end
        p.recorder.end()
        p.spike.push()  # before the action: a rollback puts back the window of its snapshot
        self.schedule.after_step(trainer, pl_module)  # a late decision taken during this batch
        outcome = p.finish(trainer, pl_module, rec)
        counters, events = p.ledger.counters, p.ledger.events
        self.progress.after_step(trainer, pl_module, rec, p.snapshots.snapshot, counters, outcome)
        p.amp.log(trainer, pl_module, counters["amp_overflow_steps"])
        last = p.spike.last  # host numbers: the counters and the spike statistics of the step's one read
        self.series.after_step(trainer, pl_module, rec.step, events, counters, last, p.spike.scalars())

    # ------------------------------------------------------------------ verbs

    def events_path(self) -> Path | None:
        reporter = self.pipeline.reporter
        return reporter.events_path if reporter is not None else None

    def close(self) -> None:
        self.pipeline.recorder.detach()
        self.pipeline.recovery.logged.release()
        if self.pipeline.reporter is not None:
            self.pipeline.reporter.close()
