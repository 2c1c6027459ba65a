"""The step's flow, written once: what happens at each moment of a training step, for both read schedules.

The front doors translate their loop's moments into these verbs, each in one line (as Lightning's
``SpikeDetection`` delegates to Fabric's utility): a fit's start (:meth:`StepFlow.setup`,
:meth:`~StepFlow.at_fit_start`, :meth:`~StepFlow.at_train_start`), a micro-batch's start
(:meth:`~StepFlow.batch_start`), the loss before its backward (:meth:`~StepFlow.before_backward`), the moment before
an optimizer steps (:meth:`~StepFlow.before_optimizer_step`), the batch's end (:meth:`~StepFlow.batch_end`), and the
fit's end. Every verb receives the loop in torch terms (:class:`~lightning_numguard.engine.loop.Loop`). The flow
wires a fit's parts once and runs them in the step's order; the one part that differs between ``sync_mode`` values is
the read schedule (:class:`~lightning_numguard.engine.schedule.ReadSchedule`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_numguard.config.arguments import GuardConfig
from lightning_numguard.detect import registry
from lightning_numguard.detect.spike_guard import STATEFUL_KEY
from lightning_numguard.engine.deferred import Deferred
from lightning_numguard.engine.fit_checks import FitChecks
from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.pipeline import StepPipeline
from lightning_numguard.engine.schedule import EveryStep, ReadSchedule
from lightning_numguard.reporting.progress import FitProgress
from lightning_numguard.reporting.series import RunSeries

__all__ = ["StepFlow", "read_schedule"]


def read_schedule(pipeline: StepPipeline) -> ReadSchedule:
    """The read schedule ``pipeline.settings.sync_mode`` names."""
    return Deferred(pipeline) if pipeline.settings.sync_mode == "deferred" else EveryStep(pipeline)


class StepFlow:
    """The parts of one fit and the order the hooks run them in."""

    def __init__(self, settings: GuardConfig, dirpath: Path | None = None, halt_dirpath: Path | None = None) -> None:
        """New parts for a fit (``dirpath``: where files go; ``None``: no file is written, except by a halt, into
        ``halt_dirpath``)."""
        self.settings = settings
        self._acting = settings.acting  # asked at every step: the configuration is read-only
        self.pipeline = StepPipeline.build(settings, dirpath, halt_dirpath)
        self.fit_checks = FitChecks(registry.fit_checks(settings))
        self.progress = FitProgress()
        sigma = settings.spikes.sigma if self.pipeline.spike.window is not None else None
        self.series = RunSeries(self.pipeline.reporter, sigma)
        self.schedule = read_schedule(self.pipeline)
        self._late = type(self.schedule).after_step is not ReadSchedule.after_step  # work at batch end (deferred)

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

    def setup(
        self, module: torch.nn.Module, settings: GuardConfig, dirpath: Path | None, halt_dirpath: Path | None = None
    ) -> StepFlow:
        """The flow of a new fit of ``module``: new parts, the module's hooks attached (before any compiled call).

        ``dirpath``: where the fit's files go (``None``: no file is written, except that a halt writes
        ``last_finite.ckpt`` and ``events.jsonl`` into ``halt_dirpath``, so that they outlive the process)."""
        self.pipeline.recorder.detach()
        flow = StepFlow(settings, dirpath, halt_dirpath)
        flow.pipeline.recorder.attach(module)
        return flow

    def at_fit_start(self, loop: Loop) -> None:
        p = self.pipeline
        stateful = loop.stateful()
        if p.spike.window is not None:  # snapshots hold the spike window: a rollback puts it back
            stateful[STATEFUL_KEY] = p.spike.window
        p.snapshots.track(stateful)
        p.reader.resolve(loop.module, stateful)
        self.fit_checks.at_fit_start(loop, p.ledger)
        p.announce_spikes(loop)

    def at_train_start(self, loop: Loop) -> None:
        # After Lightning restored optimizers, schedulers and the scaler from a checkpoint (it does so after
        # on_fit_start): a snapshot taken earlier would roll a resumed run back to fresh optimizers.
        p = self.pipeline
        p.recorder.at_train_start(loop)
        bad = p.recovery.at_train_start(loop, p.reader, self.settings.acting)
        # the fused check writes the same bits back: only while no snapshot is copied on another thread
        p.reader.allow_rewrite(not p.snapshots.async_on)
        if bad:
            p.halt_at_fit_start(loop, bad)
        self.schedule.at_train_start(loop)

    def at_train_end(self, loop: Loop) -> None:
        self.schedule.at_train_end(loop)
        self.pipeline.at_train_end(loop)  # the last step's update: checked once (one sync per fit)

    def at_save_checkpoint(self, loop: Loop, checkpoint: dict[str, Any]) -> None:
        """Last line of defence: no checkpoint written during the run holds non-finite weights (see
        :meth:`StepPipeline.swap_checkpoint
        <lightning_numguard.engine.pipeline.StepPipeline.swap_checkpoint>`)."""
        if self.settings.acting:
            self.pipeline.swap_checkpoint(loop, checkpoint)

    def at_end(self, loop: Loop, fit: bool, exception: BaseException | None = None) -> None:
        """The fit's end (Lightning's ``teardown`` or ``on_exception``): its last series and summary (how it ended,
        ``fit``: whether a fit ran); hooks off."""
        if fit:
            ended = type(exception).__name__ if exception is not None else "finished"
            ledger = self.pipeline.ledger
            events, counters = ledger.events, ledger.counters
            ledger.flush_repeats(loop)  # the actions that repeated the last one told, before the summary
            self.series.at_end(loop, events, ended)
            self.progress.report(
                loop,
                events,
                counters,
                self.events_path(),
                ended,
                resumed_from=ledger.resumed_from(),
                device_faults=ledger.device_faults,
                quarantined_steps=ledger.quarantined_steps,
            )
        self.close()

    # ------------------------------------------------------------------ every step

    def batch_start(self, loop: Loop, batch: Any, batch_idx: int) -> None:
        p = self.pipeline
        new_step = p.recorder.record is None
        acting = self._acting
        rec = p.recorder.begin(loop, batch, batch_idx, acting, p.snapshots.stateful)
        skip, flag = p.recovery.flag_batch(rec, batch, batch_idx, loop, new_step)
        if skip is not None:
            p.recorder.force_skip(skip)
        if flag is not None:
            p.recorder.flag_quarantine(flag)
        if new_step and p.snapshots.async_on:  # start the due snapshot's copies, overlapped with the step
            p.snapshots.start(loop, p.due(loop.step))
        if new_step and acting:
            loop.mark_logged()
        p.recorder.enter_ops()

    def before_backward(self, loss: torch.Tensor) -> None:
        self.pipeline.recorder.exit_ops()
        self.pipeline.recorder.record_loss(loss)

    def before_optimizer_step(self, loop: Loop, optimizer: Any) -> None:
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
        if not self.fit_checks.stepped and not rec.skip_forced:  # both read schedules: the gradients are known here
            self.fit_checks.at_first_optimizer_step(loop, optimizer, rec.batch, rec.batch_idx, self.pipeline.ledger)
        if rec.check_step is not None:  # checks passed as extra_checks
            recorder.at_optimizer_step(optimizer)
        self.schedule.at_optimizer_step(loop, optimizer)

    def batch_end(self, loop: Loop) -> None:
        p = self.pipeline
        p.recorder.exit_ops()
        rec = p.recorder.record
        if rec is None:
            return
        if not rec.read_done:
            if loop.accumulating():
                return  # the window's records are read at its optimizer step
            p.read(loop, None)  # a batch without an optimizer step is read at its end
        p.recorder.end()
        p.spike.push()  # before the action: a rollback puts back the window of its snapshot
        if self._late:
            self.schedule.after_step(loop)  # a late decision taken during this batch
        outcome = p.finish(loop, rec)
        counters, events = p.ledger.counters, p.ledger.events
        self.progress.after_step(loop, rec, p.snapshots.snapshot, counters, outcome)
        p.amp.log(loop, p.reporter, counters["amp_overflow_steps"])
        self.series.after_step(loop, rec.step, events, counters, p.spike)  # the host numbers of the step's read

    # ------------------------------------------------------------------ verbs

    def events_path(self) -> Path | None:
        reporter = self.pipeline.reporter
        return reporter.events_path if reporter is not None else None

    def close(self) -> None:
        self.pipeline.recorder.detach()
        if self.pipeline.reporter is not None:
            self.pipeline.reporter.close()
