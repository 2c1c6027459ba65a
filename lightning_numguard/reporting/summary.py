"""The end-of-fit summary: what the guard saw and did in one fit, as text and as a Rich table.

:func:`summarize` is pure (events and counters in, a :class:`FitSummary` out); :func:`summary_text`
is what goes to the ``lightning_numguard`` logger, and :func:`rich_table` what is printed under
Lightning's ``RichProgressBar``. The callback glue that picks the place is
``lightning_numguard.reporting.progress``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_numguard.reporting.events import counts_as_incident
from lightning_numguard.reporting.messages import steps_words

__all__ = ["CauseSummary", "FitSummary", "KindSummary", "rich_table", "summarize", "summary_text", "where_lines"]

_CULPRIT_WIDTH = 48  # a root cause's place, cut beyond this in the text's rows


@dataclass(frozen=True)
class KindSummary:
    """The events of one kind: how many, and the first one's step and culprit (``where[0]``)."""

    kind: str
    count: int
    first_step: int
    first_culprit: str


@dataclass(frozen=True)
class CauseSummary:
    """The root-cause events of one kind at one place (and op): each is one incident, or one warning that is none
    (``incident=False``: an optimizer coverage problem, an overflow risk, a batch field declared a convention)."""

    kind: str
    where: str
    op: str | None
    count: int
    steps: tuple[int, ...]
    incident: bool = True

    @property
    def label(self) -> str:
        """``nonfinite_output in MyVAE (op exp)``."""
        where = self.where if len(self.where) <= _CULPRIT_WIDTH else self.where[: _CULPRIT_WIDTH - 3] + "..."
        text = f"{self.kind} in {where}" if where else self.kind
        return text + (f" (op {self.op})" if self.op else "")


@dataclass(frozen=True)
class FitSummary:
    """What the guard saw and did in one fit.

    ``causes`` are the root causes in the order they first happened (each incident is counted once, at its root
    cause); ``consequences`` the events that followed from them, per kind (the same incidents: never counted);
    ``kinds`` every event per kind. The counters are the guard's (they carry over a resume); the causes, kinds and
    ``halts`` / ``repairs`` are this fit's events. ``resumed_from``: the ``events.jsonl`` of the run this one
    resumed from, when the checkpoint named one that exists.
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
    causes: tuple[CauseSummary, ...] = ()
    consequences: tuple[tuple[str, int], ...] = ()
    halts: int = 0
    repairs: int = 0
    incidents_this_fit: int | None = None
    resumed_from: str | None = None
    resumed_found: bool = True
    rollbacks_this_fit: int | None = None
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
    resumed_from: str | None = None,
    resumed_found: bool = True,
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
        resumed_from: the ``events.jsonl`` of the run this fit resumed from (``None``: none, or not resumed).
        resumed_found: whether that file is there (a checkpoint moved to another machine names a path it lacks).
        quarantined_steps: steps skipped without an incident because their batch was quarantined.
        device_faults: per rank, its ``host``, ``device`` and device faults by verdict (``transient``, ``this_rank``).
    """
    halted = {int(e.get("step", -1)) for e in events if e.get("action") == "halt"}
    repaired = {int(e.get("step", -1)) for e in events if _at_end(e) and e.get("action") == "rollback"}
    rolled = {int(e.get("step", -1)) for e in events if not _at_end(e) and e.get("action") == "rollback"}
    return FitSummary(
        kinds=_kinds(events),
        incidents=int(counters.get("incidents", 0)),
        skipped_steps=int(counters.get("skipped_steps", 0)),
        rollbacks=int(counters.get("rollbacks", 0)),
        steps_lost_to_rollbacks=int(steps_lost_to_rollbacks),
        amp_overflow_steps=int(counters.get("amp_overflow_steps", 0)),
        steps=int(steps),
        events_path=events_path,
        ended=ended,
        spikes=int(counters.get("spikes", 0)),
        causes=_causes(events),
        consequences=tuple(Counter(str(e.get("kind", "?")) for e in events if _consequence(e)).items()),
        halts=len(halted),
        repairs=len(repaired),
        incidents_this_fit=sum(1 for e in events if counts_as_incident(e)),
        resumed_from=resumed_from,
        resumed_found=resumed_found,
        rollbacks_this_fit=len(rolled),
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


def _consequence(event: Mapping[str, Any]) -> bool:
    return event.get("root_cause", True) is False


def _at_end(event: Mapping[str, Any]) -> bool:
    details = event.get("details")
    return isinstance(details, Mapping) and details.get("when") == "end of training"


def _kinds(events: Sequence[Mapping[str, Any]]) -> tuple[KindSummary, ...]:
    """Every event per kind, in the order of each kind's first event, named by its first root cause."""
    order: list[str] = []
    count: dict[str, int] = {}
    first: dict[str, tuple[int, str]] = {}
    named_by_root: set[str] = set()  # kinds whose first culprit comes from a root cause, not a consequence
    for event in events:
        kind = str(event.get("kind", "?"))
        root = not _consequence(event)
        if kind not in count:
            order.append(kind)
        if kind not in first or (root and kind not in named_by_root):
            where = event.get("where") or []
            first[kind] = (int(event.get("step", -1)), str(where[0]) if where else "")
            if root:
                named_by_root.add(kind)
        count[kind] = count.get(kind, 0) + 1
    return tuple(KindSummary(k, count[k], *first[k]) for k in order)


def _causes(events: Sequence[Mapping[str, Any]]) -> tuple[CauseSummary, ...]:
    """The root-cause events by kind, place and op, in the order each first happened."""
    found: dict[tuple[str, str, str | None, bool], list[int]] = {}
    for event in events:
        if _consequence(event):
            continue
        where = event.get("where") or []
        op = event.get("op")
        key = (str(event.get("kind", "?")), str(where[0]) if where else "", op if isinstance(op, str) else None,
               counts_as_incident(event))  # fmt: skip
        found.setdefault(key, []).append(int(event.get("step", -1)))
    return tuple(CauseSummary(k, w, op, len(s), tuple(s), incident) for (k, w, op, incident), s in found.items())


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


def _and(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _handled(s: FitSummary) -> str:
    """How the incidents were handled: each step acted on once (a rollback also drops its step's update: it is
    not a skip besides)."""
    rollbacks = max(0, s.rollbacks - s.repairs)
    skips = max(0, s.skipped_steps - rollbacks - s.halts)
    parts = [_plural(skips, "skipped step")] if skips else []
    if skips and s.quarantined_steps:
        parts[0] += f" ({s.quarantined_steps} of them quarantined batches, skipped without an incident)"
    lost = s.steps_lost_to_rollbacks  # this fit's: said only when every rollback counted is this fit's
    if rollbacks and (lost or s.rollbacks_this_fit == rollbacks):
        if lost:
            note = f"{_plural(lost, 'step')} lost"
        else:  # every rollback went back to the start of its own bad step
            note = ("each " if rollbacks > 1 else "") + "to the start of its bad step: no earlier step lost"
        parts.append(f"{_plural(rollbacks, 'rollback')} ({note})")
    elif rollbacks:
        parts.append(_plural(rollbacks, "rollback"))
    if s.halts:
        parts.append(_plural(s.halts, "halt"))
    if s.repairs:
        parts.append(f"{_plural(s.repairs, 'repair')} of the last update at the end of training")
    if not parts:
        return "recorded only: no step was skipped or rolled back" if s.incidents else ""
    return "handled by " + _and(parts)


def _others(s: FitSummary) -> list[str]:
    """What is no incident: spikes counted apart, the GradScaler's own overflow steps."""
    parts = [_plural(s.spikes, "loss or gradient-norm spike")] if s.spikes else []
    if s.amp_overflow_steps:
        parts.append(_plural(s.amp_overflow_steps, "AMP overflow step") + " (the GradScaler's, not incidents)")
    return parts


def _totals(s: FitSummary) -> str:
    """The counts after the head: how the incidents were handled, spikes and AMP overflow steps."""
    handled = _handled(s)
    return "; ".join(([handled] if handled else []) + _others(s))


def where_lines(s: FitSummary) -> list[str]:
    """Where the events are: this run's file, and the one of the run it resumed from."""
    lines = [f"events: {s.events_path}" if s.events_path else "no events written in this run"]
    if s.resumed_from and s.resumed_from != s.events_path:
        missing = "" if s.resumed_found else " (not found here)"
        lines.append(f"events of the run this one resumed from: {s.resumed_from}{missing}")
    return lines


def summary_text(s: FitSummary) -> str:
    """The summary as a few lines of plain text (the first line stands on its own)."""
    ended = "" if s.ended == "finished" else f" (the fit ended with {s.ended})"
    if not s.eventful:
        others = _others(s)
        head = f"NumGuard: no incidents in {_plural(s.steps, 'step')}{ended}"
        return head + (f"; {'; '.join(others)}." if others else ".") + " " + "; ".join(where_lines(s))
    earlier = s.incidents - (s.incidents_this_fit if s.incidents_this_fit is not None else s.incidents)
    before = f" ({earlier} of them before the resume)" if 0 < earlier < s.incidents else ""
    if earlier > 0 and earlier >= s.incidents:
        before = " (before the resume)" if s.incidents == 1 else " (all before the resume)"
    head = f"NumGuard: {_plural(s.incidents, 'incident')}{before} in {_plural(s.steps, 'step')}{ended}"
    handled = _handled(s)
    head += f", {handled}" if handled else ""
    lines = [head + "".join(f"; {other}" for other in _others(s)) + "."]
    width = max((len(c.label) for c in s.causes), default=0)
    for c in s.causes:
        note = "" if c.incident else "  (a warning, not an incident)"
        lines.append(f"  {c.label:<{width}}  x{c.count:<3} {_steps(c.steps)}{note}")
    if s.consequences:
        listed = ", ".join(f"{kind} x{n}" for kind, n in s.consequences)
        lines.append(f"  consequences (the same incidents, not counted): {listed}")
    lines += _device_lines(s)
    lines.extend(f"  {line}" for line in where_lines(s))
    return "\n".join(lines)


def _steps(steps: Sequence[int]) -> str:
    return f"step{'s' if len(set(steps)) > 1 else ''} {steps_words(steps)}"


def rich_table(s: FitSummary) -> Any:
    """The summary as a ``rich.table.Table`` (``rich`` is imported here, only when a Rich progress bar is used).

    The path to ``events.jsonl`` is not in the table: a caption is folded at the table's width, mid-word; the
    caller prints it on a line of its own.
    """
    from rich.table import Table

    caption = _totals(s)
    if s.consequences:
        caption += ("; " if caption else "") + "consequences, not counted: "
        caption += ", ".join(f"{kind} x{n}" for kind, n in s.consequences)
    table = Table(title="NumGuard", caption=caption or None)
    table.add_column("root cause")
    table.add_column("count", justify="right")
    table.add_column("steps")
    for c in s.causes:
        table.add_row(c.label + ("" if c.incident else " (warning)"), str(c.count), steps_words(c.steps))
    if not s.causes:
        table.add_row("no incidents", "0", "")
    return table
