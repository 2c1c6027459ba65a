"""Withdraw what a discarded step logged, so monitors, schedulers and loggers never see it.

``self.log(..., on_epoch=True)`` adds the value to Lightning's epoch accumulator when it is called, long
before the guard decides. A step the guard skips or rolls back must leave no trace there: its NaN would
become the epoch mean that ``EarlyStopping`` (``check_finite``) and ``ModelCheckpoint(monitor=...)`` read,
and its ``on_step`` value the one ``ReduceLROnPlateau``, the progress bar and the loggers see.

At the start of each step :meth:`LoggedValues.mark` keeps references to every result's accumulators and
copies of the three metric dicts (no tensor copy, no sync: Lightning rebinds the accumulators, it never
writes them in place). :meth:`LoggedValues.discard` puts them back and drops the step's ``on_step``
values; it runs in the guard's ``on_train_batch_end``, before Lightning folds the step's results into
``callback_metrics`` and the loggers.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl

from lightning_numguard import _compat

__all__ = ["LoggedValues"]

log = logging.getLogger(__name__)


class LoggedValues:
    """Start-of-step marks of the training results, and their withdrawal for a discarded step."""

    def __init__(self) -> None:
        self._results: dict[str, dict[str, Any]] | None = None
        self._dicts: list[dict[str, Any]] | None = None
        self._unsupported_said = False
        self._held_module: pl.LightningModule | None = None

    def mark(self, trainer: pl.Trainer) -> None:
        """Remember the accumulators as they are before this step (the first micro-batch of a window)."""
        if self._held_module is not None:
            self.release()
        results = _compat.train_results(trainer)
        dicts = _compat.logger_metric_dicts(trainer)
        if results is None or dicts is None:
            self._results = self._dicts = None
            return
        self._results = {key: _compat.result_metric_state(metric) for key, metric in results.items()} if results else {}
        self._dicts = list(map(dict, dicts))

    def discard(self, trainer: pl.Trainer) -> None:
        """Put the results back as :meth:`mark` left them: the step logged nothing."""
        results = _compat.train_results(trainer)
        dicts = _compat.logger_metric_dicts(trainer)
        if self._results is None or self._dicts is None or results is None or dicts is None:
            if not self._unsupported_said:
                self._unsupported_said = True
                log.warning(
                    "numguard cannot withdraw the values a discarded step logged with self.log on this Lightning "
                    "version; epoch means may include them (supported: Lightning 2.5-2.6)."
                )
            return
        for key in list(results):
            saved = self._results.get(key)
            if saved is None:  # first logged by the discarded step
                del results[key]
            else:
                _compat.set_result_metric_state(results[key], saved)
        for live, saved_dict in zip(dicts, self._dicts):
            live.clear()
            live.update(saved_dict)
        self._hold_plateau(trainer)

    def _hold_plateau(self, trainer: pl.Trainer) -> None:
        """Skip the next ``lr_scheduler_step`` of every step-interval ``ReduceLROnPlateau`` (until :meth:`release`).

        Lightning steps them after this hook with the monitored value, which after the discard is the previous
        step's: counted once more as a step without improvement, it would cut the learning rate. The module's
        ``lr_scheduler_step`` is wrapped for that one call (an instance attribute, removed again by
        :meth:`release`); the scheduler itself is never touched, so its ``state_dict`` stays as it is.
        """
        held = [c.scheduler for c in trainer.lr_scheduler_configs if c.reduce_on_plateau and c.interval == "step"]
        module = trainer.lightning_module
        if not held or "lr_scheduler_step" in module.__dict__:
            return
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if any(scheduler is h for h in held):
                held[:] = [h for h in held if h is not scheduler]  # the discarded step's call: skipped, once
                return
            original(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]
        self._held_module = module

    def release(self) -> None:
        """Undo :meth:`_hold_plateau` (at the next step's start: Lightning has made its calls by then)."""
        if self._held_module is not None:
            self._held_module.__dict__.pop("lr_scheduler_step", None)
            self._held_module = None
