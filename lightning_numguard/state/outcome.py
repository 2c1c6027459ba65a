"""What carrying out a step's decision did: the :class:`Outcome` the ledger records its events with.

:meth:`Recovery.carry_out <lightning_numguard.state.recovery.Recovery.carry_out>` returns one; the
events of the step were built from its findings before (by the ledger) and nobody edits them afterwards: the ledger
records them with the outcome's facts (:meth:`Outcome.said_in`) added to their details.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Outcome", "Restore"]


@dataclass(frozen=True)
class Restore:
    """A restore to a snapshot (a rollback, or a halt's return to the last finite state)."""

    snapshot_step: int
    steps_lost: int  # the updates it discarded: steps since the snapshot or the last restore whose update was made
    repeat: dict[str, Any] | None = None  # a repeat's details (callbacks/state/_repeats), else ``None``


@dataclass(frozen=True)
class Outcome:
    """What was done at batch end for one step's decision.

    Attributes:
        action: the decision's action carried out (``"none"``, ``"skip"``, ``"rollback"``, ``"halt"``).
        restore: the snapshot restored and the updates given up, when one was.
        snapshot_step: the step of the last verified snapshot once it was done (``None``: no snapshot yet).
        lr_after_backoff: the learning rates after a new rollback's back-off, when one was applied.
        retry: what re-running the batch from the restored state said, when it was re-run.
        quarantined: whether the batch was quarantined.
    """

    action: str
    restore: Restore | None = None
    snapshot_step: int | None = None
    lr_after_backoff: list[float] | None = None
    retry: str | None = None
    quarantined: bool = False

    @property
    def steps_lost(self) -> int | None:
        """The updates the restore discarded (``None``: nothing was restored)."""
        return self.restore.steps_lost if self.restore is not None else None

    def said_in(self, event: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``event`` whose details (and message) say what was done; ``event`` is left as it is."""
        details = dict(event["details"])
        message = event["message"]
        if self.restore is not None:
            details["steps_lost"] = self.restore.steps_lost
            details["snapshot_step"] = self.restore.snapshot_step
            if self.restore.repeat is not None:
                details["repeat"] = self.restore.repeat
                message += f"; {self.restore.repeat['said']}"
        if self.lr_after_backoff is not None:
            details["lr_after_backoff"] = self.lr_after_backoff
        if self.retry is not None:
            details["retry"] = self.retry
        if self.quarantined:
            details["quarantined"] = True
        if event["action"] == "rollback" and self.action != "halt" and self.snapshot_step is not None:
            details.setdefault("snapshot_step", self.snapshot_step)  # the span a rollback gave up (the run's picture)
        return {**event, "message": message, "details": details}
