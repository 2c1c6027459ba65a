"""The guard's series on the loggers, the run's trace, and its picture at the end of the fit.

At each batch end (host numbers the step's one read already brought: no device read), on global rank 0:

* on the steps the loop writes its own metrics (Lightning's ``(step + 1) % log_every_n_steps == 0``, as
  ``LearningRateMonitor`` tests it), the counters (``incidents``, ``skipped_steps``, ``rollbacks``, ``spikes``),
  the gradient norm, the z-scores and the spike threshold go to every logger directly, at the loop's step number
  (:attr:`Loop.log_step <lightning_numguard.engine.loop.Loop.log_step>`): beside the loss, and never through the
  loop's own metrics (Lightning's ``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` stay as the
  user's code left them; ``EarlyStopping`` and ``ModelCheckpoint(monitor=...)`` read those);
* at every step that had an event, or whose z-score crossed the threshold (with ``spike_action=None`` too),
  the gradient norm, the z-scores and the threshold are written directly at that step (the counters that changed
  were written with the event): every such step is a point of the curves;
* the trace (:mod:`~lightning_numguard.reporting.trace`) keeps the step's loss and gradient norm with the window's
  statistics, and scores them when it is written.

A counter is written when it changes and on the loop's logging steps, never as a copy of another one:
``incidents`` moves with root causes, ``skipped_steps`` with skips, ``rollbacks`` with rollbacks, ``spikes`` with
spikes.

At the end of a fit that had any event (or when it raises: a halt), global rank 0 writes the trace (also at
the first event and then at most every few hundred steps after events) and sends one picture
(:mod:`~lightning_numguard.reporting.plot`) to every logger that takes an image. A clean run draws nothing and
imports nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning_numguard.engine.loop import Loop
from lightning_numguard.reporting.report import Reporter, counter_scalars, is_tensorboard
from lightning_numguard.reporting.trace import TRACE_FILENAME, Trace

if TYPE_CHECKING:
    from lightning_numguard.detect.spike_guard import SpikeGuard

__all__ = ["THRESHOLD_TAG", "RunSeries"]

log = logging.getLogger(__name__)

#: A step with no event and no value above its threshold (most steps).
_NONE: frozenset[int] = frozenset()
#: The z-score above which a value is a spike, beside the z-scores (``spikes.sigma``).
THRESHOLD_TAG = "numguard/spike_threshold"


class RunSeries:
    """One fit's series, trace and picture (the reporter writes; ``sigma``: ``None`` without spike statistics)."""

    def __init__(self, reporter: Reporter, sigma: float | None) -> None:
        self.reporter = reporter
        self.sigma = sigma
        self.trace = Trace(reporter.dirpath / TRACE_FILENAME if reporter.dirpath is not None else None, sigma)
        self._seen = 0  # events already looked at
        self.pictured = False

    def after_step(
        self, loop: Loop, step: int, events: list[dict[str, Any]], counters: dict[str, int], spike: SpikeGuard
    ) -> None:
        """Batch end of ``step``: ``spike`` holds the latest host-read extras and their step (taken here, once).

        The z-scores and the scalars are worked out only where they are written: on the loop's logging steps, at a
        step with an event, at a step whose raw value reached its threshold; the trace keeps the raw values and
        scores them when it is written."""
        before, self._seen = self._seen, len(events)
        event_steps = {int(e["step"]) for e in events[before:]} if len(events) > before else _NONE
        last = spike.take_last()
        if last is not None and self.sigma is not None and spike.crossed(last[1]):
            event_steps = {*event_steps, last[0]}  # above the threshold, acted on or not (spike_action)
        if event_steps:
            self.trace.mark(event_steps)
        if last is not None:  # the extras hold the window's statistics: the trace scores them when written
            self.trace.add_read(*last)
        due = bool(loop.loggers) and loop.logs_due()
        at_event = last is not None and last[0] in event_steps and not (due and last[0] == loop.log_step)
        if due or at_event:
            scalars = spike.scalars(last[1]) if last is not None else {}
            if self.sigma is not None and any(k.endswith("zscore") for k in scalars):
                scalars[THRESHOLD_TAG] = float(self.sigma)
            if due:  # written beside the loop's own metrics, at its step number
                self.reporter.point(loop, loop.log_step, {**counter_scalars(counters), **scalars})
            if at_event and scalars:
                assert last is not None
                self.reporter.point(loop, last[0], scalars)
        if len(events) > before and loop.is_zero:
            self.trace.maybe_write(step)

    def at_end(self, loop: Loop, events: list[dict[str, Any]], ended: str = "finished") -> None:
        """End of the fit (or an exception): the trace written, and the picture sent when anything happened."""
        if not loop.is_zero or not events:  # a clean run: no file, no picture
            return
        self.trace.write(int(loop.step))
        if self.pictured or not loop.loggers:
            return
        self.pictured = True
        from lightning_numguard.reporting.plot import MissingMatplotlib, figure, send_figure

        try:
            fig = figure(events, self.trace)
        except MissingMatplotlib as err:
            log.info("%s", err)
            return
        except Exception as err:  # a picture must never hide the fit's own outcome
            log.warning("numguard could not draw the run's picture: %s", err)
            return
        took = send_figure(loop.loggers, fig, int(loop.step), is_tensorboard)
        log.debug("numguard sent the run's picture (%s) to %s", ended, ", ".join(took) or "no logger")
