"""The guard's series on the loggers, the run's trace, and its picture at the end of the fit.

At each batch end (host numbers the step's one read already brought: no device read):

* on the steps Lightning writes its own metrics (``(step + 1) % log_every_n_steps == 0``, as
  ``LearningRateMonitor`` tests it), the counters (``incidents``, ``skipped_steps``, ``rollbacks``,
  ``spikes``), the gradient norm, the z-scores and the spike threshold go through ``pl_module.log``: Lightning
  writes them in the same ``log_metrics`` call, at the same step, as the loss;
* at every step that had an event, or whose z-score crossed the threshold (with ``spike_action=None`` too),
  the gradient norm, the z-scores and the threshold are written directly at that step (the counters that changed
  were written with the event): every such step is a point of the curves;
* the trace (:mod:`~lightning_numguard.reporting.trace`) keeps the step's loss, gradient norm and z-scores.

A counter is written when it changes and on Lightning's steps, never as a copy of another one: ``incidents``
moves with root causes, ``skipped_steps`` with skips, ``rollbacks`` with rollbacks, ``spikes`` with spikes.

At the end of a fit that had any event (or when it raises: a halt), global rank 0 writes the trace (also at
the first event and then at most every few hundred steps after events) and sends one picture
(:mod:`~lightning_numguard.reporting.plot`) to every logger that takes an image. A clean run draws nothing and
imports nothing.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from lightning_numguard import _compat
from lightning_numguard.detect import spike as spike_stats
from lightning_numguard.reporting.report import Reporter, counter_scalars, is_tensorboard
from lightning_numguard.reporting.trace import TRACE_FILENAME, Trace

__all__ = ["THRESHOLD_TAG", "RunSeries"]

log = logging.getLogger(__name__)

#: The z-score above which a value is a spike, beside the z-scores (``spike_sigma``).
THRESHOLD_TAG = "numguard/spike_threshold"


class RunSeries:
    """One fit's series, trace and picture (the reporter writes; ``sigma``: ``None`` without spike statistics)."""

    def __init__(self, reporter: Reporter, sigma: float | None) -> None:
        self.reporter = reporter
        self.sigma = sigma
        self.trace = Trace(reporter.dirpath / TRACE_FILENAME if reporter.dirpath is not None else None, sigma)
        self._seen = 0  # events already looked at
        self._logged: set[str] = set()  # the tags given to pl_module.log so far
        self.pictured = False

    def after_step(
        self,
        trainer: Any,
        pl_module: Any,
        step: int,
        events: list[dict[str, Any]],
        counters: dict[str, int],
        last: tuple[int, list[float]] | None,
        spike: dict[str, float],
    ) -> None:
        """Batch end of ``step``: ``last`` is the latest host-read extras and their step, ``spike`` their scalars."""
        before, self._seen = self._seen, len(events)
        event_steps = {int(e["step"]) for e in events[before:]}
        zscores = [v for k, v in spike.items() if k.endswith("zscore")]
        if zscores and self.sigma is not None:
            spike = {**spike, THRESHOLD_TAG: float(self.sigma)}
            if last is not None and max(zscores) > self.sigma:  # above the threshold, acted on or not (spike_action)
                event_steps.add(last[0])
        if event_steps:
            self.trace.mark(event_steps)
        if last is not None:  # the extras hold the window's statistics: the trace keeps the scores made of them
            read_at, values = last
            scores = spike_stats.scores(values, self.sigma) if self.sigma is not None else [None, None]
            self.trace.add(read_at, [values[0], values[1], *(math.nan if z is None else z for z in scores)])
        due = bool(trainer.loggers) and _compat.logs_due(trainer)
        if due:  # Lightning writes these with its own metrics, at this step
            scalars = self.reporter.unwritten(step, {**counter_scalars(counters), **spike})
            self._forget(trainer, self._logged - set(scalars))
            self._logged |= set(scalars)
            for key, value in scalars.items():
                pl_module.log(key, torch.tensor(value), on_step=True, on_epoch=False, logger=True, batch_size=1)
        if last is not None and spike and last[0] in event_steps and not (due and last[0] == step):
            self.reporter.point(trainer, last[0], spike)
        if len(events) > before and trainer.is_global_zero:
            self.trace.maybe_write(step)

    @staticmethod
    def _forget(trainer: Any, tags: set[str]) -> None:
        """Lightning writes a value ``pl_module.log`` kept at each of its logging steps until the epoch ends: a tag
        not logged at this one (no gradient norm at a NaN step; written directly at an event) is withdrawn."""
        results = _compat.train_results(trainer) or {}
        for tag in tags:
            item = results.get(f"on_train_batch_end.{tag}")
            if item is not None:
                item.reset()

    def at_end(self, trainer: Any, events: list[dict[str, Any]], ended: str = "finished") -> None:
        """End of the fit (or an exception): the trace written, and the picture sent when anything happened."""
        if not trainer.is_global_zero or not events:  # a clean run: no file, no picture
            return
        self.trace.write(int(trainer.global_step))
        if self.pictured or not trainer.loggers:
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
        took = send_figure(trainer.loggers, fig, int(trainer.global_step), is_tensorboard)
        log.debug("numguard sent the run's picture (%s) to %s", ended, ", ".join(took) or "no logger")
