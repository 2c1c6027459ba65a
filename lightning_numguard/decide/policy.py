"""What to do about a step: pure decisions, no tensors and no Lightning.

The callback gathers what was found, then asks these functions what to do; the tables in
``tests/decide/test_policy.py`` are the specification.
"""

from __future__ import annotations

from lightning_numguard.reporting.events import acting

__all__ = ["decide", "is_amp_overflow", "snapshot_due"]


def decide(
    action: str,
    *,
    state_bad: bool,
    has_incident: bool,
    have_snapshot: bool,
    rollbacks_used: int,
    max_rollbacks: int,
) -> str:
    """The configured ``action``, escalated where it cannot do its job.

    * ``skip`` → ``rollback`` when the weights, buffers or optimizer state themselves went bad
      (a skipped step would keep them);
    * ``rollback`` → ``halt`` without a verified-finite snapshot, or when an incident would exceed
      ``max_rollbacks``;
    * ``warn`` and ``halt`` stay as they are.

    Example:
        >>> decide("skip", state_bad=True, has_incident=True, have_snapshot=True, rollbacks_used=0, max_rollbacks=3)
        'rollback'
    """
    if action == "skip" and state_bad:
        action = "rollback"
    if action == "rollback" and (not have_snapshot or (has_incident and rollbacks_used >= max_rollbacks)):
        action = "halt"
    return action


def is_amp_overflow(*, grads_bad: bool, has_scaler: bool, local_incident: bool, state_bad: bool) -> bool:
    """Whether non-finite gradients are the fp16 GradScaler's business, not an incident.

    Under a GradScaler, inf/NaN gradients with finite inputs, outputs, loss and state are the
    scaler's normal overflow: it skips the step and lowers its scale by itself.
    """
    return grads_bad and has_scaler and not local_incident and not state_bad


def snapshot_due(action: str, step: int, last_snapshot_step: int, every: int) -> bool:
    """Whether the state at the start of ``step`` should become the new snapshot once verified."""
    return acting(action) and step - last_snapshot_step >= every
