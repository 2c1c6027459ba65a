"""One step pipeline for both read schedules: read → diagnose → judge → carry out → record.

``sync_mode="every_step"`` reads a step's packed flags at its optimizer step (:meth:`StepPipeline.read`);
``sync_mode="deferred"`` reads them one step later (:mod:`~lightning_numguard.engine.deferred`). Both hand
the read to :meth:`StepPipeline.judge`, which names the culprits with the one builder
(:func:`~lightning_numguard.diagnose.builder.diagnose`), asks :func:`~lightning_numguard.decide.judge.judge`
what to do, and moves the counters (:class:`~lightning_numguard.reporting.ledger.Ledger`, their one owner).
:meth:`StepPipeline.finish` carries the decision out at batch end
(:class:`~lightning_numguard.state.recovery.Recovery`, the one part that changes training state) and
records its events.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_numguard.config.arguments import GuardConfig
from lightning_numguard.decide import policy
from lightning_numguard.decide.judge import Budget, Decision, Facts, judge
from lightning_numguard.decide.repeats import place_of
from lightning_numguard.detect import flags, registry
from lightning_numguard.detect.conventions import InputConventions
from lightning_numguard.detect.spike_guard import SpikeGuard
from lightning_numguard.diagnose.builder import StepView, diagnose
from lightning_numguard.diagnose.findings import Finding
from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.read import StepRead
from lightning_numguard.engine.record import StepRecord, StepRecorder
from lightning_numguard.errors import NonFiniteError, SuspectedHardwareError
from lightning_numguard.reporting.amp import AmpCounters
from lightning_numguard.reporting.ledger import Ledger
from lightning_numguard.reporting.report import Reporter
from lightning_numguard.state.outcome import Outcome
from lightning_numguard.state.quarantine import position_key
from lightning_numguard.state.recovery import Recovery
from lightning_numguard.state.snapshots import Snapshots

__all__ = ["StepPipeline"]

log = logging.getLogger(__name__)


@dataclass
class StepPipeline:
    """The parts of one fit, wired once; every step of both schedules goes through :meth:`judge`."""

    settings: GuardConfig
    recorder: StepRecorder
    reader: StepRead
    snapshots: Snapshots
    recovery: Recovery
    ledger: Ledger
    spike: SpikeGuard
    conventions: InputConventions
    amp: AmpCounters
    reporter: Reporter

    #: where a halt writes its files when ``dirpath`` is ``None`` (``None``: nowhere)
    halt_dirpath: Path | None = None
    #: a clean step's decision by (snapshot due, read late): judged once per fit (:meth:`_clean`)
    _clean_decisions: dict[tuple[bool, bool], Decision] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, s: GuardConfig, dirpath: Path | None, halt_dirpath: Path | None = None) -> StepPipeline:
        """The parts of a fit, wired (``dirpath``: where files go; ``None``: no file is written, except by a halt,
        into ``halt_dirpath``)."""
        conventions = InputConventions()  # batch fields flagged step after step: no longer checked
        r, k = s.recovery, s.spikes
        reporter = Reporter(dirpath, warn=s.emit_warnings)
        # the deferred candidates shard the same way; they are copied synchronously
        snapshots = Snapshots(
            s.snapshot.device, s.snapshot.sharding, s.snapshot.asynchronous if s.sync_mode != "deferred" else False
        )
        recovery = Recovery(
            dirpath, snapshots, s.skip_batches_after_rollback, s.lr_backoff, r.retry_transient, r.quarantine
        )
        spike = SpikeGuard(s.spike_action, k.sigma, k.window, k.judged_after, k.rollback_after, k.overflow_headroom)
        recorder, reader = _instruments(s, spike, conventions)
        return cls(
            s,
            recorder,
            reader,
            snapshots,
            recovery,
            Ledger(reporter),
            spike,
            conventions,
            AmpCounters(),
            reporter,
            halt_dirpath if dirpath is None else None,
        )

    def without_instruments(self) -> StepPipeline:
        """A copy with a new recorder and read (hooks, the op-guard mode and the step record belong to a running
        fit: pickling keeps the rest; ``setup`` builds them again)."""
        recorder, reader = _instruments(self.settings, self.spike, self.conventions)
        return replace(self, recorder=recorder, reader=reader)

    def due(self, step: int) -> bool:
        """Whether the state at the start of ``step`` is due to become the snapshot once verified."""
        s = self.settings
        return policy.snapshot_due(s.action, step, self.snapshots.last_step, s.snapshot_every_n_steps)

    def read(self, loop: Loop, optimizer: Any) -> None:
        """Read at the step: the one host read, the judgement, and what must happen before the optimizer step."""
        rec = self.recorder.record
        assert rec is not None
        step = loop.step  # read once: the loop's step is a chain of properties
        due = self.due(step)
        reading = self.reader.read(loop, optimizer, due, step)
        decision = self.judge(loop, StepView(rec, reading), due)
        self.recovery.at_read(loop, rec, decision, optimizer)
        self.snapshots.settle()

    def judge(self, loop: Loop, view: StepView, due: bool) -> Decision:
        """Name the culprits of a read, judge it, move the counters; the recorder settles the decision and events."""
        rec, seen, late = view.rec, view.reading.flags, view.late
        s = self.settings
        extras = view.reading.extras  # the spike statistics' values of the read (none: they are off)
        spikes, advisory = (
            self.spike.findings(extras, rec.step, self.recorder.watch, loop.world_size) if extras else ([], [])
        )
        if seen is flags.CLEAN and not spikes and not advisory and not rec.skip_forced:  # the usual step, first
            self.conventions.clean_step()
            return self._clean(rec, due, late)
        if seen.seen(flags.QUARANTINE):
            self.recorder.force_skip("it holds samples quarantined after they failed before", rec)
        findings: list[Finding] = []
        events: list[dict[str, Any]] = []
        if rec.skip_forced:  # a batch known to be bad: skipped without an incident
            quarantined = "quarantined" in str(rec.forced_skip)
            state_bad = view.state_bad(loop, self.reader)
            facts = Facts(forced_skip=True, state_bad=state_bad, late=late, quarantined=quarantined)
            log.info("numguard skipped batch %s at step %s: %s", rec.batch_idx, rec.step, rec.forced_skip)
        elif seen.any:
            view.point_to_bad_micro_batch(loop, self.recorder)  # under accumulation: the micro-batch that went bad
            found = diagnose(loop, self.recorder, self.reader, view, s.recovery.replay and s.acting, s.acting)
            if found.amp_overflow:
                advisory += self._loss_scale(loop)
            findings, declared = self.conventions.sort(found.findings)  # a field flagged step after step: not a fault
            events = self._conventions_declared(loop, declared, rec)
            incident = [f for f in findings if not registry.is_advisory(f.kind)]
            key = position_key(rec.batch, rec.batch_idx)
            failures = self.recovery.quarantine.count_failure(key) if incident else 0
            root = next((f for f in incident if f.root_cause), None)
            facts = Facts(
                incident=bool(incident),
                state_bad=bool(found.state_bad),
                amp_overflow=found.amp_overflow,
                failures=failures,
                snapshot_due=due,
                late=late,
                device_skipped=late and s.acting,  # every flagged step is skipped on the device when read late
                broken=_broken(findings),
                place=place_of(loop, root.kind, root.where, key) if root is not None else None,
                device_fault=root.details.get("device_fault") if root is not None else None,
            )
        else:
            self.conventions.clean_step()
            if not spikes and not advisory:  # the usual step: judged once per fit for each (due, late)
                return self._clean(rec, due, late)
            wanted = self.spike.decide(rec.step) if spikes else None
            if wanted != s.spike_action:
                escalated = f"{s.spikes.rollback_after} spikes within {s.spikes.window} steps"
                spikes = [replace(f, details={**f.details, "escalated": escalated}) for f in spikes]
            findings = spikes
            place = place_of(loop, spikes[0].kind, spikes[0].where, None) if spikes else None
            facts = Facts(spike=wanted, snapshot_due=due, late=late, place=place)
        findings = advisory + findings  # advisory findings (overflow risks) are judged too: reported, never acted on
        decision = judge(
            s.action, facts, self._budget(facts), quarantine=s.recovery.quarantine, retry=s.recovery.retry_transient
        )
        # a quarantined batch counts in the run of bad steps; a skip in the window after a rollback neither counts nor
        # breaks it
        self.ledger.judged(facts.incident, facts.forced_skip, facts.quarantined)
        for f in findings:
            advisory_kind = registry.is_advisory(f.kind)
            f = f if advisory_kind else view.marked(f, loop.step)
            taken = "none" if advisory_kind else decision.action  # an advisory finding is not acted on
            events.append(self.ledger.event(loop, f, rec.step, taken, rec.epoch, rec.batch_idx))
        self.recorder.settle(rec, decision, events)
        self.ledger.count(decision.counts)
        if late and decision.action != "none":
            log.info("numguard (deferred) step %s, read at step %s: %s", rec.step, loop.step, decision.action)
        return decision

    def _clean(self, rec: StepRecord, due: bool, late: bool) -> Decision:
        """A clean step's judgement: nothing found, so it depends only on whether the snapshot is due and the read
        late, and is judged once per fit for each (the facts, budget and decision of every other step are built
        anew). The run of bad steps ends; no counter moves."""
        decision = self._clean_decisions.get((due, late))
        if decision is None:
            facts = Facts(snapshot_due=due, late=late)
            s = self.settings
            decision = judge(
                s.action, facts, self._budget(facts), quarantine=s.recovery.quarantine, retry=s.recovery.retry_transient
            )
            assert decision.action == "none", decision  # nothing to carry out
            assert not decision.counts, decision  # nothing to count
            self._clean_decisions[(due, late)] = decision
        self.ledger.judged(False, False)
        self.recorder.settle(rec, decision, [])
        return decision

    def _budget(self, facts: Facts) -> Budget:
        """What recovery has left for a step of these ``facts``: the snapshot, the rollbacks, the rollbacks of the
        same trouble at the same place, the steps in a row with an incident and the device faults of its rank."""
        s, r = self.settings, self.settings.recovery
        same, shared = self.recovery.restores.repeats.times_at(facts.place)
        fault = facts.device_fault
        return Budget(
            self.snapshots.snapshot is not None,
            self.ledger.rollbacks_this_fit,
            s.max_rollbacks,
            self.recovery.restores.repeats.cause,
            same_place=same,
            same_place_said=facts.place.said(shared) if shared is not None else None,
            bad_steps=self.ledger.bad_run,
            max_bad_steps=r.max_bad_steps,
            device_faults=self.ledger.device_faults_of(fault) + 1 if fault is not None else 0,
            max_device_faults=r.max_device_faults,
        )

    def finish(self, loop: Loop, rec: StepRecord) -> Outcome | None:
        """Batch end: carry out the step's decision and record its events with what was done (counted first: the
        ``last_finite.ckpt`` of a rollback or halt counts its incident). Returns the outcome (``None``: clean)."""
        decision = rec.decision
        if decision is None or (decision.action == "none" and not rec.events):  # a clean step: nothing left to do
            return None
        if decision.action == "halt":
            self._halt_files(loop)
            self.ledger.record(loop, rec.events)
        else:  # counted first: the last_finite.ckpt a rollback writes holds the fit's counters, this step's included
            self.ledger.count_events(rec.events)
        outcome = self.recovery.carry_out(loop, rec)
        if decision.action == "halt":  # written before: the fit's record of them says what was done
            self.ledger.complete(rec.events, outcome)
        else:
            self.ledger.record(loop, rec.events, counted=True, outcome=outcome)
        ckpt = self.recovery.ckpt_path
        self.ledger.log_action(loop, rec, outcome.snapshot_step, ckpt, outcome.steps_lost)
        if decision.action == "halt" and (self.settings.recovery.halt_raises or not loop.will_stop()):
            hardware = decision.hardware
            if hardware is not None:
                raise SuspectedHardwareError(
                    self._halt_message(loop, rec),
                    int(hardware["rank"]),
                    str(hardware["host"]),
                    str(hardware["device"]),
                    int(hardware["faults"]),
                )
            raise NonFiniteError(self._halt_message(loop, rec))
        return outcome

    def _halt_files(self, loop: Loop) -> None:
        """A halt outlives the process: when the run writes no file, ``last_finite.ckpt`` and ``events.jsonl`` (the
        fit's events so far, then the halt's) go into :attr:`halt_dirpath` all the same (every rank: the checkpoint
        is collective)."""
        folder = self.halt_dirpath
        if folder is None or self.recovery.dirpath is not None:
            return
        self.recovery.dirpath = folder
        self.reporter.open(loop, folder, self.ledger.events)

    def _halt_message(self, loop: Loop, rec: StepRecord) -> str:
        """What a halt raises: why, where the last finite state is, and how to resume from it."""
        ckpt = self.recovery.ckpt_path
        forced = f"batch {rec.batch_idx} was skipped: {rec.forced_skip}" if rec.forced_skip else "non-finite values"
        why = next((e["message"] for e in rec.events if e["action"] == "halt"), forced).rstrip(".")
        decision = rec.decision
        text = f"NumGuard halted training at step {rec.step}: {why}"
        if decision is not None and decision.escalation:
            text += f" (escalated from {decision.configured!r}: {decision.escalation})"
        if ckpt is None:
            return text + ". The last finite state was restored in memory (no file is written in this run)."
        if not ckpt.exists():  # no verified-finite state to save (none was kept, or none is finite)
            events = self.reporter.events_path
            where = f"; the events are in {events}" if events is not None else ""
            return text + f". No finite state was kept to write to {ckpt}{where}."
        events = self.reporter.events_path
        where = f" (events: {events})" if events is not None else ""
        return (
            text + f". The last finite state is in {ckpt}{where}: fix the cause, then resume with "
            f"{loop.resume_hint(ckpt)}."
        )

    # ------------------------------------------------------------------ once per fit or per checkpoint

    def announce_spikes(self, loop: Loop) -> None:
        """Fit start, with ``spike_action`` set: one line (the loop's INFO, where its own fit-start lines go) saying
        when spike detection arms, or, when the fit ends before it can, one warning instead."""
        line, warning = self.spike.arming(loop.max_steps, loop.step)
        if line is not None and warning is None:
            loop.info(line)
        if warning is not None:
            self.reporter.say_once(loop, "spike warm-up", warning)

    def halt_at_fit_start(self, loop: Loop, bad: list[str]) -> None:
        """The weights are non-finite before the first step: recorded, and (unless ``"warn"``) refused."""
        finding = Finding("nonfinite_param", bad, {"when": "fit start"})
        self.ledger.record(loop, [self.ledger.event(loop, finding, 0, "none")])
        if self.settings.acting:
            raise NonFiniteError(
                f"NumGuard: the weights or optimizer state are already non-finite at fit start ({bad[:3]}); "
                "there is no finite state to protect. Resume from an earlier checkpoint."
            )

    def at_train_end(self, loop: Loop) -> None:
        """The last step's update has not been checked yet: check it once, repair it (from the snapshot)."""
        end = self.recovery.at_train_end(loop, self.reader, not self.settings.acting)
        if end is not None:
            bad, action, details = end
            self.ledger.count({"rollbacks": int(action == "rollback")})  # the repair restored from the snapshot
            finding = Finding("nonfinite_param", bad, details, self.recovery.bad_rank)
            self.ledger.record(loop, [self.ledger.event(loop, finding, loop.step, action)])

    def swap_checkpoint(self, loop: Loop, checkpoint: dict[str, Any]) -> None:
        """No checkpoint written during the run holds non-finite weights.

        Runs for every checkpoint any callback saves (``ModelCheckpoint``, ``OnExceptionCheckpoint``,
        a loop's own save), on every rank. A weight or optimizer state that went non-finite in the
        optimizer step itself is only seen at the next step's read; if a checkpoint is written in between, its
        model and optimizer states are replaced by the last verified-finite snapshot.
        """
        if not self.recovery.swap_checkpoint(loop, checkpoint, self.reader.unchecked_buffers):
            return
        assert self.snapshots.snapshot is not None
        details = {
            "when": "while saving a checkpoint",
            "snapshot_step": self.snapshots.snapshot.step,
            "after": "the update of the step just done (the next read names what went bad)",
        }
        # a consequence of the weights the update made non-finite, which the next read (or the fit's end) names and
        # counts: one poisoned weight is one incident, not two
        finding = Finding(
            "nonfinite_param", ["checkpoint"], details, self.recovery.bad_rank, root_cause=False,
            consequence_of="nonfinite_param",
        )  # fmt: skip
        self.ledger.record(loop, [self.ledger.event(loop, finding, loop.step, "none")])

    # ------------------------------------------------------------------ parts

    def _loss_scale(self, loop: Loop) -> list[Finding]:
        """The GradScaler's own overflow: a collapsing loss scale is reported like a block near its dtype's limit."""
        collapsed = self.amp.after_overflow(loop)
        risk = self.spike.loss_scale_finding(collapsed) if collapsed is not None else None
        return [risk] if risk is not None else []

    def _conventions_declared(self, loop: Loop, declared: list[Finding], rec: StepRecord) -> list[dict[str, Any]]:
        """The events (action ``"none"``) of batch fields declared conventions at this step, each said once."""
        events = [self.ledger.event(loop, f, rec.step, "none", rec.epoch, rec.batch_idx) for f in declared]
        for event in events:
            self.reporter.say_once(loop, f"convention {event['where']}", event["message"])
        return events


def _broken(findings: list[Finding]) -> str | None:
    """Why a step halts for a batch field flagged on step after step with values that are no mask, or ``None``."""
    persistent = [f for f in findings if f.details.get("persistent")]
    if not persistent:
        return None
    steps = persistent[0].details["persistent"]["steps"]
    return f"{', '.join(persistent[0].where)} was flagged on {steps} consecutive steps: the data pipeline is broken"


def _instruments(s: GuardConfig, spike: SpikeGuard, conventions: InputConventions) -> tuple[StepRecorder, StepRead]:
    """A fit's step recorder and read: the recorder leaves out the fields declared conventions; the read carries the
    spike statistics after its flags."""
    per_step = tuple(c for c in registry.fit_checks(s) if c.records_at is not None)  # the rest look at the fit once
    recorder = StepRecorder(
        list(s.check), s.watch.modules, s.watch.ignore, s.watch.depth, conventions.ignored, per_step
    )
    return recorder, StepRead(list(s.check), s.max_abs_input, recorder, spike)
