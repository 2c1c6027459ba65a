"""The run's trace: per-step loss, gradient norm and z-scores in ``trace.csv`` beside ``events.jsonl``.

The values are the ones the step's one read already brought to the host (the spike statistics' extras): no
extra read. The file is bounded for runs of millions of steps: every step is kept until :data:`MAX_POINTS`
points are held, then every other one (the stride doubles, again and again), while the steps that had an
event are always kept (up to :data:`MAX_EVENT_POINTS` of them). The file is rewritten whole (a few hundred
KiB at most) at the end of the fit, when it raises, and at most every :data:`WRITE_EVERY` steps after an
event; ``numguard plot`` draws the run from it and ``events.jsonl``.

Format: ``#``-comment lines (``# sigma=6.0``), a header ``step,loss,grad_norm,loss_z,grad_norm_z``, one row
per kept step; ``nan`` where a value was missing, non-finite or not judged yet.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_numguard.detect import spike

__all__ = ["COLUMNS", "MAX_EVENT_POINTS", "MAX_POINTS", "TRACE_FILENAME", "Trace", "read_trace"]

#: The trace's file name, beside ``events.jsonl``.
TRACE_FILENAME = "trace.csv"
#: Points held before the stride doubles (besides the event steps).
MAX_POINTS = 4096
#: Event steps always kept (the latest, beyond this many).
MAX_EVENT_POINTS = 4096
#: Steps between two rewrites of the file after events (the end of the fit always writes it).
WRITE_EVERY = 200
#: The columns after ``step``.
COLUMNS: tuple[str, ...] = ("loss", "grad_norm", "loss_z", "grad_norm_z")
#: Below this a read value is a mark for "missing" or "not judged" (``core.spike.NOT_JUDGED``).
_MISSING = -1.0e29


def _clean(value: float) -> float:
    return float(value) if math.isfinite(value) and value > _MISSING else math.nan


@dataclass
class Trace:
    """The bounded per-step record of one fit (global rank 0 writes it; ``path=None``: kept in memory only)."""

    path: Path | None = None
    sigma: float | None = None
    max_points: int = MAX_POINTS
    stride: int = 1
    points: dict[int, tuple[float, ...]] = field(default_factory=dict)
    events: dict[int, None] = field(default_factory=dict)  # event steps, in the order first seen
    _written_at: int | None = None

    def add(self, step: int, values: Sequence[float]) -> None:
        """``step``'s host-read loss and gradient norm and their scores (``[loss, grad_norm, loss_z, grad_norm_z]``;
        ``NaN``: not judged)."""
        self._keep(step, tuple(map(_clean, values[:4])))

    def add_read(self, step: int, extras: Sequence[float]) -> None:
        """``step``'s host-read spike extras (:data:`~lightning_numguard.detect.spike.EXTRAS`: the loss, the
        gradient norm, their centers and thresholds first), kept as read: scored (with :attr:`sigma`) and cleaned
        when the rows are taken, so that a step costs a tuple."""
        self._keep(step, tuple(extras[:6]))

    def _keep(self, step: int, point: tuple[float, ...]) -> None:
        if step % self.stride and step not in self.events:
            return
        self.points[step] = point
        if len(self.points) > self.max_points + len(self.events):
            self.stride *= 2
            self.points = {s: v for s, v in self.points.items() if not s % self.stride or s in self.events}

    def mark(self, steps: Iterable[int]) -> None:
        """Steps that had an event: kept whatever the stride."""
        for step in steps:
            self.events[step] = None
        while len(self.events) > MAX_EVENT_POINTS:
            del self.events[next(iter(self.events))]

    def rows(self) -> list[tuple[int, float, float, float, float]]:
        """The kept points, in step order (a step later rolled back and run again keeps its last values)."""
        return [(s, *self._row(self.points[s])) for s in sorted(self.points)]  # type: ignore[misc]

    def _row(self, point: tuple[float, ...]) -> tuple[float, ...]:
        """A kept point as its row's four values: a step's raw extras (:meth:`add_read`) scored and cleaned."""
        if len(point) == len(COLUMNS):
            return point
        scores = [None, None] if self.sigma is None else spike.scores(point, self.sigma)
        return (_clean(point[0]), _clean(point[1]), *(math.nan if z is None else float(z) for z in scores))

    def maybe_write(self, step: int) -> None:
        """After an event: write now unless the file was written less than :data:`WRITE_EVERY` steps ago."""
        if self._written_at is None or step - self._written_at >= WRITE_EVERY or step < self._written_at:
            self.write(step)

    def write(self, step: int | None = None) -> Path | None:
        """Rewrite the file whole (atomically); ``None`` when there is no file or nothing to write."""
        if self.path is None or not self.points:
            return None
        self._written_at = step if step is not None else self._written_at
        head = [f"# sigma={self.sigma}"] if self.sigma is not None else []
        lines = [*head, f"# stride={self.stride}", ",".join(("step", *COLUMNS))]
        lines += [",".join([str(s), *(f"{v:.7g}" for v in values)]) for s, *values in self.rows()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".csv.tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
        return self.path


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """A trace written by :meth:`Trace.write` (its ``path`` is the file read; rows that do not parse are left out)."""
    trace = Trace(Path(path), max_points=2**62)
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            key, _, value = line[1:].strip().partition("=")
            if key == "sigma":
                trace.sigma = float(value)
            continue
        cells = line.split(",")
        if len(cells) != 1 + len(COLUMNS) or cells[0] == "step":
            continue
        try:
            trace.points[int(cells[0])] = tuple(float(c) for c in cells[1:])
        except ValueError:
            continue
    return trace
