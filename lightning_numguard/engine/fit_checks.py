"""The checks that look at a fit on the host, once (:meth:`Check.at_fit_start`, :meth:`Check.at_first_optimizer_step`).

Each check's findings become events at once (advisory or not, as the check declares); a fatal check
(:attr:`Check.fatal`: ``check_optimizer_coverage="error"``) raises ``NumGuardError`` with their sentences after
they are recorded. No device value, no read: what these hooks look at is on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lightning_numguard.detect.check import Check, CheckStep
from lightning_numguard.diagnose.findings import Finding
from lightning_numguard.engine.loop import Loop
from lightning_numguard.errors import NumGuardError
from lightning_numguard.reporting.ledger import Ledger

__all__ = ["FitChecks"]


class FitChecks:
    """The host-side hooks of a fit's checks, each run once per fit."""

    def __init__(self, checks: Sequence[Check]) -> None:
        self.checks = tuple(c for c in checks if c.looks_at_fit)
        self.stepped = False

    def at_fit_start(self, loop: Loop, ledger: Ledger) -> None:
        step = CheckStep(loop, None, -1, loop.step)
        for check in self.checks:
            _report(check, loop, ledger, check.at_fit_start(step))

    def at_first_optimizer_step(self, loop: Loop, optimizer: Any, batch: Any, batch_idx: int, ledger: Ledger) -> None:
        """Once per fit, just before the first optimizer step runs (later calls do nothing)."""
        if self.stepped:
            return
        self.stepped = True
        step = CheckStep(loop, batch, batch_idx, loop.step, optimizer=optimizer)
        for check in self.checks:
            _report(check, loop, ledger, check.at_first_optimizer_step(step))


def _report(check: Check, loop: Loop, ledger: Ledger, findings: Sequence[Finding]) -> None:
    if not findings:
        return
    if not check.builtin:  # a user's check is named in its events, as by the per-step path (detect/extra.findings)
        findings = [
            replace(f, details={**f.details, "check": f.details.get("check", type(check).__name__)}) for f in findings
        ]
    events = [ledger.event(loop, f, loop.step, "none") for f in findings]
    ledger.record(loop, events)
    if check.fatal:
        raise NumGuardError("NumGuard: " + " | ".join(e["message"] for e in events))
