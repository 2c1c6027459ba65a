"""The guard's record of what happened: the one owner of its events and counters, handed to reporting.

The ledger builds each event (:meth:`Ledger.event`) and records it; what carrying a decision out did (an
:class:`~lightning_numguard.state.outcome.Outcome`) is added to the events when they are recorded, never
written into events already built."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_numguard.diagnose.findings import Finding
from lightning_numguard.engine.loop import Loop
from lightning_numguard.reporting.events import Event, acting, counts_as_incident
from lightning_numguard.reporting.messages import action_message, cause_words, incident_message, repeat_message
from lightning_numguard.reporting.report import Reporter
from lightning_numguard.state.outcome import Outcome

__all__ = ["COUNTERS", "REPEATS_PER_LINE", "Ledger"]

log = logging.getLogger("lightning_numguard")

#: The running counters, logged as ``numguard/<name>`` scalars.
COUNTERS: tuple[str, ...] = ("incidents", "skipped_steps", "rollbacks", "amp_overflow_steps", "spikes")

#: Repeats of one action for the same cause gathered into one console line at most (a long run still hears of them).
REPEATS_PER_LINE = 25


class Ledger:
    """Events and counters of one fit; every recorded event goes to the :class:`Reporter` too."""

    def __init__(self, reporter: Reporter | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.incidents_by_kind: dict[str, int] = {}
        self.rollbacks_this_fit = 0  # what max_rollbacks limits (``counters["rollbacks"]`` carries over a resume)
        self.bad_run = 0  # steps with an incident in a row, up to the last one judged (what max_bad_steps limits)
        self.quarantined_steps = 0  # steps of this fit skipped without an incident: their batch was quarantined
        #: device faults per rank, with its host and device (carried over a resume: what max_device_faults limits)
        self.device_faults: dict[int, dict[str, Any]] = {}
        self.reporter = reporter
        self.earlier_events: list[str] = []  # events.jsonl of the runs this fit resumed from (a checkpoint's)
        self._told: tuple[str, str] | None = None  # the action and cause of the last action line
        self._told_root: dict[str, Any] | None = None
        self._again: list[int] = []  # steps that repeated it since

    def load(
        self,
        counters: Mapping[str, int],
        incidents_by_kind: Mapping[str, int],
        events_files: Sequence[str] = (),
        device_faults: Mapping[int, dict[str, Any]] | None = None,
    ) -> None:
        """The counters, incident counts, earlier runs' ``events.jsonl`` and device faults of a checkpoint (already
        validated): a resumed run goes on counting, and its summary points at the events of the run it resumed from."""
        self.counters.update(counters)
        self.incidents_by_kind = dict(incidents_by_kind)
        self.earlier_events = list(events_files)
        self.device_faults = {int(k): dict(v) for k, v in (device_faults or {}).items()}

    def events_files(self) -> list[str]:
        """The ``events.jsonl`` of the runs so far, oldest first, this run's last (absolute paths; what a checkpoint
        carries). This run's is named even before anything is written to it: a later incident may be."""
        mine = self._own_events()
        return [f for f in self.earlier_events if f != mine] + ([mine] if mine else [])

    def resumed_from(self) -> str | None:
        """The ``events.jsonl`` of the run this one resumed from (the last earlier one that is not this run's)."""
        mine = self._own_events()
        return next((f for f in reversed(self.earlier_events) if f != mine), None)

    def _own_events(self) -> str | None:
        path = self.reporter.events_file if self.reporter is not None else None
        return os.path.abspath(path) if path is not None else None

    def count(self, counts: Mapping[str, int]) -> None:
        """Move the counters by a decision's ``counts`` (``incidents`` is counted from recorded events)."""
        for name, n in counts.items():
            self.counters[name] += n
        self.rollbacks_this_fit += counts.get("rollbacks", 0)

    def count_events(self, events: list[dict[str, Any]]) -> None:
        """Count ``events`` in ``incidents`` and the counts by kind, before they are recorded (a rollback's
        ``last_finite.ckpt``, written before its events are complete, holds the fit's counters); a root cause that
        was a device fault counts for its rank."""
        self.counters["incidents"] += sum(1 for e in events if counts_as_incident(e))
        for e in events:
            self.incidents_by_kind[e["kind"]] = self.incidents_by_kind.get(e["kind"], 0) + 1
            fault = (e.get("details") or {}).get("device_fault")
            if fault and counts_as_incident(e):
                rank = int(fault.get("rank", e["rank"]))
                entry = self.device_faults.setdefault(rank, {"host": fault.get("host"), "device": fault.get("device")})
                verdict = str(fault.get("verdict", "transient"))
                entry[verdict] = int(entry.get(verdict, 0)) + 1

    def device_faults_of(self, fault: Mapping[str, Any]) -> int:
        """The device faults counted so far on the rank of ``fault`` (a finding's ``details["device_fault"]``)."""
        entry = self.device_faults.get(int(fault.get("rank", -1)), {})
        return sum(int(v) for k, v in entry.items() if k not in ("host", "device"))

    def judged(self, incident: bool, neutral: bool, quarantined: bool = False) -> None:
        """A step was judged: one more in the run of steps that went bad (an ``incident``, or a ``quarantined``
        batch), or the run is over (a clean step); another batch skipped without an incident (``neutral``: in the
        window after a rollback) neither counts nor breaks it."""
        self.quarantined_steps += int(quarantined)
        if incident or quarantined:
            self.bad_run += 1
        elif not neutral:
            self.bad_run = 0

    def event(
        self,
        loop: Loop,
        finding: Finding,
        step: int,
        action: str,
        epoch: int | None = None,
        batch_idx: int = -1,
    ) -> dict[str, Any]:
        """The event dict of ``finding``, with its message (the rank is the one that saw it, else this one)."""
        rank = loop.rank if finding.rank < 0 else finding.rank
        return Event(
            kind=finding.kind,
            step=step,
            epoch=loop.epoch if epoch is None else epoch,
            batch_idx=batch_idx,
            rank=rank,
            where=list(finding.where),
            action=action,
            message=incident_message(
                finding.kind,
                finding.where,
                finding.details,
                step,
                rank,
                op=finding.op,
                module=finding.module,
                site=finding.site,
                source=finding.source,
            ),
            details=finding.details,
            op=finding.op,
            module=finding.module,
            site=finding.site,
            source=finding.source,
            root_cause=finding.root_cause,
            consequence_of=finding.consequence_of,
        ).to_dict()

    def record(
        self, loop: Loop, events: list[dict[str, Any]], counted: bool = False, outcome: Outcome | None = None
    ) -> None:
        """Count ``events`` (unless :meth:`count_events` already did), keep them, and report them (files and loggers
        on rank 0); with ``outcome``, what carrying their decision out did is said in each.

        ``incidents`` counts root causes only: a consequence (``root_cause: false``) is recorded,
        labelled and reported, but it is the same incident.
        """
        if not events:
            return
        if outcome is not None:
            events = [outcome.said_in(e) for e in events]
        if not counted:
            self.count_events(events)
        self.events.extend(events)
        if self.reporter is not None:
            self.reporter.emit(loop, events, self.counters)

    def complete(self, events: list[dict[str, Any]], outcome: Outcome) -> None:
        """A halt's ``events``, recorded (and written) before it was carried out: the fit's record of them
        (``callback.events``) says what was done too (the file keeps them as they were written)."""
        done = {id(e): outcome.said_in(e) for e in events}
        self.events[:] = [done.get(id(e), e) for e in self.events]

    def log_action(
        self, loop: Loop, rec: Any, snapshot_step: int | None, ckpt: Any, steps_lost: int | None = None
    ) -> None:
        """One WARNING (``skip``, ``rollback``) or ERROR (``halt``) log line on rank 0 per action taken, and one
        line for the actions that repeat it.

        The first action for a root cause says it all (what was done, why, what was lost, where the files are). A
        skip or rollback at a later step for the same cause is a line of its own at INFO only (for log files); the
        console gets one WARNING for them, "rolled back again at steps 7, 9, 11 (same cause: ...)", when another
        cause or a halt comes, every :data:`REPEATS_PER_LINE` repeats, and at the fit's end
        (:meth:`flush_repeats`).

        Args:
            loop: the loop.
            rec: the step's record (its ``decision``, ``events`` and ``step``).
            snapshot_step: the step of the snapshot a rollback or halt went back to.
            ckpt: ``last_finite.ckpt``'s path, when one is written in this run.
            steps_lost: the updates the restore of a rollback or halt discarded (its outcome's).
        """
        decision = rec.decision
        if not acting(rec.action) or not rec.events or not loop.is_zero:
            return
        acted = [e for e in rec.events if e["action"] == rec.action] or rec.events  # not a field declared a convention
        root = next((e for e in acted if e.get("root_cause", True)), acted[0])
        written = rec.action in ("rollback", "halt") and ckpt is not None and ckpt.exists()
        events_file = self.reporter.events_path if self.reporter is not None else None
        text = action_message(
            rec.action,
            decision.configured,
            rec.step,
            root,
            decision.escalation,
            snapshot_step if rec.action != "skip" else None,
            str(ckpt) if written else None,
            str(events_file) if events_file else None,
            steps_lost,
        )
        told = (rec.action, cause_words(root))
        if rec.action != "halt" and told == self._told:  # the same story again: said once, with the others
            log.info("%s", text)
            self._again.append(int(rec.step))
            if len(self._again) >= REPEATS_PER_LINE:
                self.flush_repeats(loop)
            return
        self.flush_repeats(loop)
        self._told, self._told_root = told, root
        log.log(logging.ERROR if rec.action == "halt" else logging.WARNING, "%s", text)

    def flush_repeats(self, loop: Loop) -> None:
        """The one WARNING line of the actions that repeated the last one told, if any (rank 0)."""
        if not self._again or not loop.is_zero or self._told is None:
            return
        steps, self._again = self._again, []
        log.warning("%s", repeat_message(self._told[0], steps, self._told_root))
