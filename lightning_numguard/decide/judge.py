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
        place: where the trouble happened (:class:`~lightning_numguard.decide.repeats.Place`: its kind and name, the
            LR schedule's position, the batch), which the decision carries to the rollback's repeats.
        device_fault: the step's root cause is a fault of a device (``rank``, ``host``, ``device``, ``verdict``): the
            replay did not reproduce it, or only its own rank did. ``None``: not a device fault.
        quarantined: a forced skip of a quarantined batch (it counts against ``max_bad_steps``; a skip in the window
            after a rollback does not).
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
    place: Any = None
    device_fault: Mapping[str, Any] | None = None
    quarantined: bool = False


@dataclass(frozen=True)
class Budget:
    """What recovery has left: a verified snapshot, and the rollbacks used of those allowed in this fit (and, when
    rollbacks to the same snapshot repeat, the cause they share, which a halt then names).

    Attributes:
        same_place: earlier rollbacks of this step's trouble at the same place (its schedule position or batch), and
            ``same_place_said``, that place in words: a third rollback there halts instead.
        bad_steps: the steps with an incident in a row before this one, of ``max_bad_steps`` allowed under ``skip``
            and ``warn`` (0: no limit).
        device_faults: the device faults of this step's rank so far, this one included, of ``max_device_faults``
            allowed (0: no limit).
    """

    have_snapshot: bool
    rollbacks_used: int
    max_rollbacks: int
    repeating: str | None = None  # what repeated rollbacks to the same snapshot had in common, if they did
    same_place: int = 0
    same_place_said: str | None = None
    bad_steps: int = 0
    max_bad_steps: int = 0
    device_faults: int = 0
    max_device_faults: int = 0


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
        place: where the step's trouble happened (the facts'), for the rollback's repeats.
        hardware: the device fault that made the step halt (``rank``, ``host``, ``device``, ``faults``): the halt
            raises :class:`~lightning_numguard.errors.SuspectedHardwareError`. ``None``: not a hardware halt.
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
    place: Any = None
    hardware: Mapping[str, Any] | None = None
    #: whether the optimizer step is a no-op (the gradients are dropped, or the device skipped it): of ``action``,
    #: worked out once (asked at every step)
    skips: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "skips", acting(self.action))


def judge(action: str, facts: Facts, budget: Budget, *, quarantine: bool = True, retry: bool = False) -> Decision:
    """The :class:`Decision` for a step, given the configured ``action`` and what its read found (see
    :func:`_judge`); read late, the decision says the device already skipped the step."""
    decision = _judge(action, facts, budget, quarantine=quarantine, retry=retry)
    if facts.place is not None:
        decision = replace(decision, place=facts.place)
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
        stop = _bad_run(action, facts, budget) if facts.quarantined else None
        taken = "halt" if stop is not None else taken
        return Decision(
            action=taken,
            configured=action,
            escalation=stop,
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
        return replace(decision, keep_start=False, drop_start=late and facts.spike != "warn")
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
    stop, hardware = _stop(taken, configured, facts, budget)
    if stop is not None:
        taken = "halt"
    skips = taken in ("skip", "rollback", "halt")
    counts = {**counts, **({"skipped_steps": 1} if skips else {})}
    if taken == "rollback":
        counts["rollbacks"] = 1
    return Decision(
        action=taken,
        configured=configured,
        escalation=stop if stop is not None else _escalation(taken, configured, budget),
        hardware=hardware,
        counts=counts,
        # the state before this step is verified finite: a rollback undoes exactly this step
        keep_start=skips and not facts.state_bad and not facts.late and facts.spike is None,
        drop_start=facts.late,
        restore=taken in ("rollback", "halt"),
        new_rollback=taken == "rollback",
        quarantine=FAILED_TWICE if quarantine and taken in ("skip", "rollback") and facts.failures >= 2 else None,
    )


def _stop(taken: str, configured: str, facts: Facts, budget: Budget) -> tuple[str | None, dict[str, Any] | None]:
    """Why an incident halts although ``taken`` would go on (``None``: it does not), and the device fault of a
    hardware halt: a broken data pipeline; a rank whose device has made ``max_device_faults`` faults; the same trouble
    rolled back twice at the same place already (a third rollback would loop); under ``skip`` and ``warn``,
    ``max_bad_steps`` steps with an incident in a row (no step has trained since the first of them)."""
    if taken == "halt":
        return None, None
    if facts.broken and taken in ("skip", "rollback"):
        return facts.broken, None
    fault = facts.device_fault
    if fault is not None and budget.max_device_faults and budget.device_faults >= budget.max_device_faults:
        host, device, rank = fault.get("host", "?"), fault.get("device", "?"), fault.get("rank", -1)
        said = (
            f"{budget.device_faults} device faults on rank {rank} (host {host}, device {device}; "
            f"recovery.max_device_faults={budget.max_device_faults}): exclude this node and resume"
        )
        return said, {"rank": rank, "host": host, "device": device, "faults": budget.device_faults}
    if taken == "rollback" and budget.same_place >= 2:
        where = budget.same_place_said or "the same place"
        return f"{where} came back after {budget.same_place} rollbacks: a third would loop", None
    return (_bad_run(configured, facts, budget) if facts.incident else None), None


def _bad_run(configured: str, facts: Facts, budget: Budget) -> str | None:
    """Under ``skip`` and ``warn``: why a step that went bad (an incident, or a quarantined batch) halts, the
    ``max_bad_steps``-th in a row; ``None`` while the run is shorter."""
    bad_run = budget.bad_steps + 1
    if configured not in ("skip", "warn") or not budget.max_bad_steps or bad_run < budget.max_bad_steps:
        return None
    return (
        f"{bad_run} steps in a row went bad (an incident, or a batch quarantined for one; "
        f"recovery.max_bad_steps={budget.max_bad_steps}): none of them trained"
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
