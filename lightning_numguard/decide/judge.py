"""What to do about one step's read: a pure judgement, the same for both read schedules.

The callback reads a step's packed flags either at its optimizer step (``sync_mode="every_step"``) or one
step later (``sync_mode="deferred"``). Either way, what the read found is summed up as :class:`Facts`, and
:func:`judge` answers with a :class:`Decision`: the action, why it escalated, how the counters move, what
becomes of the snapshot and whether the batch is quarantined. ``callbacks/state/_recovery`` carries the decision
out on the training state and ``callbacks/state/_ledger`` applies its counts; nothing here touches a tensor.

The table in ``tests/decide/test_judge.py`` is the specification.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_numguard.decide.policy import decide
from lightning_numguard.reporting.events import acting

__all__ = ["Budget", "Decision", "Facts", "judge"]

#: The reason a batch that failed twice is quarantined.
FAILED_TWICE = "failed at the same position more than once"


@dataclass(frozen=True)
class Facts:
    """What one step's read found (after the culprits were named and conventions set aside).

    Attributes:
        incident: findings remain to act on (a non-finite or suspicious value that is not a data convention).
        state_bad: the weights, the buffers at the step's start or the optimizer state are non-finite.
        spike: a finite spike's action, already escalated by repeated spikes (``None``: no spike).
        forced_skip: the batch is skipped without an incident (quarantined, or in the window after a rollback).
        amp_overflow: the fp16 GradScaler's own overflow (it skips the step itself; not an incident).
        failures: incidents at this batch position so far, this one included.
        snapshot_due: the state at the step's start is due to become the snapshot once verified.
        late: read one step late (``sync_mode="deferred"``): the device already skipped a bad step, and the
            snapshot candidates taken since are verified or dropped by this read.
        device_skipped: read late, the device skipped the step on its flags, although nothing is left to act on
            (a batch field declared a convention of the data at this read): it still counts as skipped.
        broken: why acting again is pointless (a batch field flagged on step after step with values that are no
            mask: a broken data pipeline); a ``skip`` or ``rollback`` then halts, saying so. ``None``: not broken.
    """

    incident: bool = False
    state_bad: bool = False
    spike: str | None = None
    forced_skip: bool = False
    amp_overflow: bool = False
    failures: int = 0
    snapshot_due: bool = False
    late: bool = False
    device_skipped: bool = False
    broken: str | None = None


@dataclass(frozen=True)
class Budget:
    """What recovery has left: a verified snapshot, and the rollbacks used of those allowed in this fit (and, when
    rollbacks to the same snapshot repeat, the cause they share, which a halt then names)."""

    have_snapshot: bool
    rollbacks_used: int
    max_rollbacks: int
    repeating: str | None = None  # what repeated rollbacks to the same snapshot had in common, if they did


@dataclass(frozen=True)
class Decision:
    """What to do about a step.

    Attributes:
        action: ``"none"`` (nothing to act on), ``"warn"``, ``"skip"``, ``"rollback"`` or ``"halt"``.
        configured: the action asked for (the callback's ``action``, or the spike's), to name an escalation.
        escalation: why ``action`` differs from ``configured`` (``None`` when it does not).
        counts: how the counters move (``skipped_steps``, ``rollbacks``, ``spikes``, ``amp_overflow_steps``);
            ``incidents`` is counted from the recorded events.
        keep_start: the state at the step's start was verified finite: it becomes the snapshot (read late:
            the candidates taken up to this step are verified).
        drop_start: read late: the candidates taken at or after this step hold its damage and are dropped.
        restore: the last verified snapshot is put back (a rollback, or a halt before it saves).
        new_rollback: a new rollback: its skip window, learning-rate back-off, retry and ``last_finite.ckpt``.
        quarantine: quarantine the batch now, for this reason (``None``: not now).
        on_device: read late: the device already skipped the step (nothing of its forward pass to undo on the host).
    """

    action: str = "none"
    configured: str = "none"
    escalation: str | None = None
    counts: Mapping[str, int] = field(default_factory=dict)
    keep_start: bool = False
    drop_start: bool = False
    restore: bool = False
    new_rollback: bool = False
    quarantine: str | None = None
    on_device: bool = False

    @property
    def skips(self) -> bool:
        """Whether the optimizer step is a no-op (the gradients are dropped, or the device skipped it)."""
        return acting(self.action)


def judge(action: str, facts: Facts, budget: Budget, *, quarantine: bool = True, retry: bool = False) -> Decision:
    """The :class:`Decision` for a step, given the configured ``action`` and what its read found (see
    :func:`_judge`); read late, the decision says the device already skipped the step."""
    decision = _judge(action, facts, budget, quarantine=quarantine, retry=retry)
    return replace(decision, on_device=True) if facts.late else decision


def _judge(action: str, facts: Facts, budget: Budget, *, quarantine: bool = True, retry: bool = False) -> Decision:
    """The :class:`Decision` for a step, given the configured ``action`` and what its read found.

    Args:
        action: ``NumGuardCallback(action=...)``.
        facts: what the read found.
        budget: what recovery has left.
        quarantine: ``recovery.quarantine``: a batch position failing twice is quarantined.
        retry: ``recovery.retry_transient``: a rollback re-runs the batch, whose outcome decides the quarantine
            instead.

    Example:
        >>> d = judge("skip", Facts(incident=True, state_bad=True), Budget(True, 0, 3))
        >>> d.action, d.restore, dict(d.counts)
        ('rollback', True, {'skipped_steps': 1, 'rollbacks': 1})
    """
    late = facts.late
    if facts.forced_skip:  # a batch known to be bad: skipped without an incident, no rollback counted
        taken = decide(action, state_bad=False, has_incident=False, **_budget(budget))
        if taken == "warn" or late:  # a quarantine from a resumed run is kept under "warn" too; late: on the device
            taken = "skip"
        return Decision(
            action=taken,
            configured=action,
            counts={"skipped_steps": 1},
            keep_start=not facts.state_bad,
            drop_start=late and facts.state_bad,
            restore=not late and taken in ("rollback", "halt"),
        )
    amp = {"amp_overflow_steps": 1} if facts.amp_overflow else {}
    if facts.incident:
        return _act(action, action, facts, budget, amp, quarantine and not retry)
    if facts.spike is not None:
        decision = _act(facts.spike, facts.spike, facts, budget, {"spikes": 1}, False)
        # a spike's state is finite but not one to come back to: not kept; read late, its candidates go
        return Decision(**{**decision.__dict__, "keep_start": False, "drop_start": late and facts.spike != "warn"})
    if late and facts.device_skipped:  # nothing to act on, but the step did not train: said as a skip
        return Decision(action="skip", configured="skip", counts={"skipped_steps": 1}, keep_start=True)
    # a clean step (or the GradScaler's own overflow): read late, it verifies the candidates taken up to it
    return Decision(counts=amp, configured=action, keep_start=late or facts.snapshot_due)


def _act(
    action: str, configured: str, facts: Facts, budget: Budget, counts: dict[str, int], quarantine: bool
) -> Decision:
    taken = decide(action, state_bad=facts.state_bad, has_incident=True, **_budget(budget))
    if facts.late and taken == "rollback" and not facts.state_bad and facts.spike is None:
        taken = configured = "skip"  # the device skipped the step and the state stayed finite: nothing to restore
    if facts.broken and taken in ("skip", "rollback"):
        taken = "halt"
    skips = taken in ("skip", "rollback", "halt")
    counts = {**counts, **({"skipped_steps": 1} if skips else {})}
    if taken == "rollback":
        counts["rollbacks"] = 1
    return Decision(
        action=taken,
        configured=configured,
        escalation=facts.broken
        if facts.broken and taken == "halt" != configured
        else _escalation(taken, configured, budget),
        counts=counts,
        # the state before this step is verified finite: a rollback undoes exactly this step
        keep_start=skips and not facts.state_bad and not facts.late and facts.spike is None,
        drop_start=facts.late,
        restore=taken in ("rollback", "halt"),
        new_rollback=taken == "rollback",
        quarantine=FAILED_TWICE if quarantine and taken in ("skip", "rollback") and facts.failures >= 2 else None,
    )


def _escalation(taken: str, configured: str, budget: Budget) -> str | None:
    if taken == configured:
        return None
    if not budget.have_snapshot:
        return "there is no verified-finite snapshot to go back to"
    if taken == "halt":
        said = f"max_rollbacks reached ({budget.rollbacks_used} rollbacks in this fit)"
        return f"{said}; the rollbacks repeat: {budget.repeating}" if budget.repeating else said
    return "the weights or optimizer state were no longer finite"


def _budget(budget: Budget) -> dict[str, Any]:
    return {
        "have_snapshot": budget.have_snapshot,
        "rollbacks_used": budget.rollbacks_used,
        "max_rollbacks": budget.max_rollbacks,
    }
