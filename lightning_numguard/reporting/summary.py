"""The end-of-fit summary: what the guard saw and did in one fit, as text and as a Rich table.

:func:`summarize` is pure (events and counters in, a :class:`FitSummary` out); :func:`summary_text`
is what goes to the ``lightning_numguard`` logger, and :func:`rich_table` what is printed under
Lightning's ``RichProgressBar``. The callback glue that picks the place is
``lightning_numguard.reporting.progress``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FitSummary", "KindSummary", "rich_table", "summarize", "summary_text"]


@dataclass(frozen=True)
class KindSummary:
    """The events of one kind: how many, and the first one's step and culprit (``where[0]``)."""

    kind: str
    count: int
    first_step: int
    first_culprit: str


@dataclass(frozen=True)
class FitSummary:
    """What the guard saw and did in one fit.

    ``kinds`` are in the order their first event happened, so the first row holds the root cause.
    The counters are the callback's (they carry over a resume); the kinds are this fit's events.
    """

    kinds: tuple[KindSummary, ...]
    incidents: int
    skipped_steps: int
    rollbacks: int
    steps_lost_to_rollbacks: int
    amp_overflow_steps: int
    steps: int
    events_path: str | None
    ended: str = "finished"
    spikes: int = 0
    quarantined_steps: int = 0
    #: per rank: ``(rank, host, device, {verdict: count})`` of the device faults counted (this fit and those it resumed)
    device_faults: tuple[tuple[int, str, str, tuple[tuple[str, int], ...]], ...] = ()

    @property
    def eventful(self) -> bool:
        """Whether anything happened that a user should read about."""
        return bool(self.kinds or self.incidents or self.skipped_steps or self.rollbacks or self.device_faults)


def summarize(
    events: Sequence[Mapping[str, Any]],
    counters: Mapping[str, int],
    steps_lost_to_rollbacks: int,
    steps: int,
    events_path: str | None,
    ended: str = "finished",
    quarantined_steps: int = 0,
    device_faults: Mapping[int, Mapping[str, Any]] | None = None,
) -> FitSummary:
    """Fold a fit's ``events`` (in the order recorded) and the guard's ``counters`` into a :class:`FitSummary`.

    Args:
        events: the event dicts of the fit (``callback.events``).
        counters: ``incidents``, ``skipped_steps``, ``rollbacks``, ``amp_overflow_steps``, ``spikes`` (missing
            ones are 0).
        steps_lost_to_rollbacks: clean optimizer steps whose updates rollbacks discarded.
        steps: the global step at the end of the fit.
        events_path: where ``events.jsonl`` is, or ``None`` when nothing was written.
        ended: how the fit ended (``"finished"``, or the name of the exception that stopped it).
        quarantined_steps: steps skipped without an incident because their batch was quarantined.
        device_faults: per rank, its ``host``, ``device`` and device faults by verdict (``transient``, ``this_rank``).
    """
    order: list[str] = []
    count: dict[str, int] = {}
    first: dict[str, tuple[int, str]] = {}
    named_by_root: set[str] = set()  # kinds whose first culprit comes from a root cause, not a consequence
    for event in events:
        kind = str(event.get("kind", "?"))
        root = event.get("root_cause", True) is not False
        if kind not in count:
            order.append(kind)
        if kind not in first or (root and kind not in named_by_root):
            where = event.get("where") or []
            first[kind] = (int(event.get("step", -1)), str(where[0]) if where else "")
            if root:
                named_by_root.add(kind)
        count[kind] = count.get(kind, 0) + 1
    return FitSummary(
        kinds=tuple(KindSummary(k, count[k], *first[k]) for k in order),
        incidents=int(counters.get("incidents", 0)),
        skipped_steps=int(counters.get("skipped_steps", 0)),
        rollbacks=int(counters.get("rollbacks", 0)),
        steps_lost_to_rollbacks=int(steps_lost_to_rollbacks),
        amp_overflow_steps=int(counters.get("amp_overflow_steps", 0)),
        steps=int(steps),
        events_path=events_path,
        ended=ended,
        spikes=int(counters.get("spikes", 0)),
        quarantined_steps=int(quarantined_steps),
        device_faults=tuple(
            (
                int(rank),
                str(entry.get("host")),
                str(entry.get("device")),
                tuple((str(k), int(v)) for k, v in entry.items() if k not in ("host", "device")),
            )
            for rank, entry in sorted((device_faults or {}).items())
        ),
    )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


#: how a device fault's verdict is said in the summary
_VERDICTS = {"transient": "transient", "this_rank": "on this rank's device only"}


def _device_lines(s: FitSummary) -> list[str]:
    """One line per rank whose device made faults: its host, device and faults by verdict."""
    lines = []
    for rank, host, device, counts in s.device_faults:
        said = ", ".join(f"{n} {_VERDICTS.get(v, v)}" for v, n in counts)
        lines.append(f"  device faults on rank {rank} (host {host}, device {device}): {said}")
    return lines


def _totals(s: FitSummary) -> str:
    skipped = _plural(s.skipped_steps, "step") + " skipped"
    if s.quarantined_steps:
        skipped += f" ({s.quarantined_steps} of them quarantined batches, skipped without an incident)"
    parts = [skipped, _plural(s.rollbacks, "rollback")]
    if s.rollbacks and s.steps_lost_to_rollbacks:
        parts[-1] += f" ({_plural(s.steps_lost_to_rollbacks, 'step')} lost to rollbacks)"
    elif s.rollbacks:  # every rollback went back to the start of its own bad step
        to = "each to the start of its" if s.rollbacks > 1 else "to the start of the"
        parts[-1] += f" ({to} bad step: no earlier step lost)"
    if s.spikes:
        parts.append(_plural(s.spikes, "loss or gradient-norm spike"))
    if s.amp_overflow_steps:
        parts.append(_plural(s.amp_overflow_steps, "AMP overflow step") + " (the GradScaler's, not incidents)")
    return ", ".join(parts)


def summary_text(s: FitSummary) -> str:
    """The summary as a few lines of plain text (the first line stands on its own)."""
    ended = "" if s.ended == "finished" else f" (the fit ended with {s.ended})"
    where = f"events: {s.events_path}" if s.events_path else "no events written"
    if not s.eventful:
        head = f"NumGuard: no incidents in {_plural(s.steps, 'step')}{ended}"
        return head + (f"; {_totals(s)}." if s.amp_overflow_steps else ".") + f" {where}"
    lines = [f"NumGuard: {_plural(s.incidents, 'incident')} in {_plural(s.steps, 'step')}{ended}; {_totals(s)}."]
    width = max((len(k.kind) for k in s.kinds), default=0)
    for k in s.kinds:
        culprit = f": {k.first_culprit}" if k.first_culprit else ""
        lines.append(f"  {k.kind:<{width}}  x{k.count:<3} first at step {k.first_step}{culprit}")
    lines += _device_lines(s)
    lines.append(f"  {where}")
    return "\n".join(lines)


def rich_table(s: FitSummary) -> Any:
    """The summary as a ``rich.table.Table`` (``rich`` is imported here, only when a Rich progress bar is used).

    The path to ``events.jsonl`` is not in the table: a caption is folded at the table's width, mid-word; the
    caller prints it on a line of its own.
    """
    from rich.table import Table

    table = Table(title="NumGuard", caption=_totals(s))
    table.add_column("kind")
    table.add_column("count", justify="right")
    table.add_column("first at step", justify="right")
    table.add_column("first culprit")
    for k in s.kinds:
        table.add_row(k.kind, str(k.count), str(k.first_step), k.first_culprit)
    if not s.kinds:
        table.add_row("no incidents", "0", "", "")
    return table
