"""Optimizer coverage: the problems found at fit start and at the first optimizer step, as events."""

from __future__ import annotations

from typing import Any

from lightning_numguard.detect.coverage import NO_GRAD_IN_FIRST_STEP, check_coverage, never_got_grad
from lightning_numguard.diagnose.findings import Finding
from lightning_numguard.engine.loop import Loop
from lightning_numguard.errors import NumGuardError
from lightning_numguard.reporting.hints import coverage_problem
from lightning_numguard.reporting.ledger import Ledger

__all__ = ["CoverageCheck"]


class CoverageCheck:
    """Reports optimizer coverage problems once per fit; ``mode="error"`` raises after recording them."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.grads_checked = False

    def at_fit_start(self, loop: Loop, ledger: Ledger) -> None:
        """Trainable parameters in no optimizer, frozen ones in one, parameters in two groups."""
        if self.mode == "off":
            return
        problems = check_coverage(loop.module, loop.optimizers).problems()
        self._report(loop, ledger, [_finding(code, names) for code, names in problems])

    def at_first_step(self, loop: Loop, optimizer: Any, ledger: Ledger) -> None:
        """Once per fit, at the first optimizer step: trainable parameters that got no gradient."""
        if self.grads_checked or self.mode == "off":
            return
        self.grads_checked = True
        missing = never_got_grad(loop.module, [p for g in optimizer.param_groups for p in g["params"]])
        if missing:
            self._report(loop, ledger, [_finding(NO_GRAD_IN_FIRST_STEP, missing)])

    def _report(self, loop: Loop, ledger: Ledger, findings: list[Finding]) -> None:
        if not findings:
            return
        events = [ledger.event(loop, f, loop.step, "none") for f in findings]
        ledger.record(loop, events)
        if self.mode == "error":
            raise NumGuardError("NumGuard: " + " | ".join(e["message"] for e in events))


def _finding(code: str, names: list[str]) -> Finding:
    problem, hint = coverage_problem(code)
    return Finding("optimizer_coverage", names, {"problem": problem, "hint": hint, "code": code})
