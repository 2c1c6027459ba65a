"""Writes incidents to ``events.jsonl``, to every logger of the loop, and as warnings.

Only global rank 0 writes files and loggers; every rank keeps the same ``events`` list.

Scalars reach the loggers directly, never through the loop's own metrics: on the steps the loop writes its own
metrics (Lightning's ``(step + 1) % log_every_n_steps == 0``, at its step number: see
:mod:`~lightning_numguard.reporting.series`), so that a clean run shows the guard at work and its points line
up with the loss curve; and at every step that had an event (:meth:`Reporter.emit` writes the counters that
changed, with the text; :meth:`Reporter.point` the step's gradient norm and z-scores). A step's scalar is written
once, whichever way comes first. Every scalar is a host number already read: a device tensor would be read here,
a host sync; read it in the step's one read instead.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_numguard import _compat
from lightning_numguard.diagnose.usercode import user_frame
from lightning_numguard.engine.loop import Loop
from lightning_numguard.errors import NumGuardWarning
from lightning_numguard.reporting.events import JsonlWriter

__all__ = ["SERIES_COUNTERS", "Reporter", "counter_scalars", "is_tensorboard", "warn_at_user_code"]

log = logging.getLogger(__name__)


#: The counters written on Lightning's logging steps (``amp_overflow_steps`` is logged under a GradScaler only).
SERIES_COUNTERS: tuple[str, ...] = ("incidents", "skipped_steps", "rollbacks", "spikes")


_COUNTER_TAGS = frozenset(f"numguard/{name}" for name in (*SERIES_COUNTERS, "amp_overflow_steps"))


def counter_scalars(counters: Mapping[str, int], names: Sequence[str] = SERIES_COUNTERS) -> dict[str, float]:
    """``numguard/<name>`` scalars of the host counters ``names`` (no device read)."""
    return {f"numguard/{name}": float(counters.get(name, 0)) for name in names}


def is_tensorboard(logger: Any) -> bool:
    """Whether ``logger`` is a ``TensorBoardLogger`` (of ``pytorch_lightning``, ``lightning.pytorch`` or Lightning
    Fabric: the classes are distinct, and share the name and the ``experiment.add_text`` the events go to).

    Matched by class name, so that the engine imports none of the Lightning packages.
    """
    return any(cls.__name__ == "TensorBoardLogger" for cls in type(logger).__mro__)


def warn_at_user_code(message: str, category: type[Warning] = NumGuardWarning) -> None:
    """``warnings.warn`` attributed to the user's innermost frame (the line calling ``trainer.fit``, a
    ``training_step``...), never to a line inside this package, torch or Lightning."""
    frame = user_frame(_compat.caller_frame(1))
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    module = str(frame.f_globals.get("__name__", "__main__"))
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno, module, registry)


class Reporter:
    """Fans events out to ``events.jsonl``, loggers and warnings: one per root cause's kind and place.

    ``dirpath=None``: no file is written (``fast_dev_run``, or no logger, no checkpointing and no
    ``dirpath``); events stay in memory (``callback.events``), in the log and in the loggers.
    """

    def __init__(self, dirpath: Path | None, warn: bool = True) -> None:
        self.dirpath = dirpath
        self.writer = JsonlWriter(dirpath / "events.jsonl") if dirpath is not None else None
        self._warned: set[tuple[str, str]] = set()
        self._said: set[str] = set()
        self._written: tuple[int, set[str]] = (-1, set())  # the last step scalars were written at, and their tags
        self._counted: dict[str, int] = {}  # the counters as last written to the loggers
        self.warn = warn

    def open(self, loop: Loop, dirpath: Path, earlier: list[dict[str, Any]]) -> None:
        """Start writing into ``dirpath`` in a run that wrote no file (a halt's files outlive the process):
        ``events.jsonl`` begins with the ``earlier`` events (global rank 0 writes)."""
        self.dirpath = dirpath
        self.writer = JsonlWriter(dirpath / "events.jsonl")
        if earlier and loop.is_zero:
            self.writer.write(earlier)

    def emit(self, loop: Loop, events: list[dict[str, Any]], counters: dict[str, int]) -> None:
        """Record ``events`` (already in causal order) and the running ``counters``."""
        if not events:
            return
        for event in events:
            key = (event["kind"], event["where"][0] if event["where"] else "")
            # a consequence (root_cause: False) is the same incident: recorded and logged, not warned again
            if (
                self.warn
                and event.get("root_cause", True)
                and key not in self._warned
                and not (event.get("details") or {}).get("convention")
            ):
                self._warned.add(key)
                if loop.is_zero:
                    warn_at_user_code(f"NumGuard: {event['message']}")
            log.info("numguard %s at step %s: %s", event["kind"], event["step"], event["message"])
        if not loop.is_zero:
            return
        if self.writer is not None:
            self.writer.write(events)
        step = int(events[-1]["step"])
        # the counters that changed (amp_overflow_steps moves only under a GradScaler): the curves say different things
        changed = [k for k, v in counters.items() if v != self._counted.get(k, 0)]
        self._counted.update({k: counters[k] for k in changed})
        scalars = counter_scalars(counters, changed)
        text = "\n\n".join(
            f"**{e['kind']}** (step {e['step']}, rank {e['rank']}, action `{e['action']}`): {e['message']}"
            for e in events
        )
        self._note_written(step, scalars)
        for lg in loop.loggers:
            try:
                if scalars:
                    lg.log_metrics(scalars, step=step)
                if is_tensorboard(lg):
                    lg.experiment.add_text("numguard/events", text, global_step=step)
                    lg.experiment.flush()
                elif callable(getattr(lg, "save", None)):
                    lg.save()
            except Exception as err:  # a broken logger must not kill training
                log.warning("numguard could not write to logger %s: %s", type(lg).__name__, err)

    def unwritten(self, step: int, scalars: Mapping[str, float]) -> dict[str, float]:
        """The part of ``scalars`` not written at ``step`` yet; noted as written from now on."""
        last_step, tags = self._written
        due = {k: v for k, v in scalars.items() if not (step == last_step and k in tags)}
        self._note_written(step, due)
        self._counted.update({k.removeprefix("numguard/"): int(v) for k, v in due.items() if k in _COUNTER_TAGS})
        return due

    def point(self, loop: Loop, step: int, scalars: Mapping[str, float]) -> None:
        """``scalars`` at ``step`` to every logger, directly (on global rank 0); a tag already written at ``step`` is
        not written again. No flush."""
        due = self.unwritten(step, scalars)
        if not due or not loop.is_zero:
            return
        for lg in loop.loggers:
            try:
                lg.log_metrics(due, step=step)
            except Exception as err:  # a broken logger must not kill training
                log.warning("numguard could not write to logger %s: %s", type(lg).__name__, err)

    def _note_written(self, step: int, scalars: Mapping[str, float]) -> None:
        last_step, tags = self._written
        self._written = (step, (tags if step == last_step else set()) | set(scalars))

    def say_once(self, loop: Loop, key: str, message: str) -> None:
        """A condition that is not an incident (a collapsing fp16 loss scale): said once per fit, on rank 0: a warning
        (``emit_warnings``, with an INFO line for log files), else a WARNING log line; never both on the console."""
        if key in self._said:
            return
        self._said.add(key)
        if self.warn and loop.is_zero:
            log.info("numguard: %s", message)
            warn_at_user_code(f"NumGuard: {message}")
        else:
            log.log(logging.WARNING if loop.is_zero else logging.INFO, "numguard: %s", message)

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()

    @property
    def events_file(self) -> Path | None:
        """Where this run's ``events.jsonl`` goes (written or not yet), else ``None`` (no file in this run)."""
        return self.writer.path if self.writer is not None else None

    @property
    def events_path(self) -> Path | None:
        """``events.jsonl`` once something was written to it, else ``None``."""
        if self.writer is None or not self.writer.path.exists():
            return None
        return self.writer.path
