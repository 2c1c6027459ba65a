"""The optimizer's coverage of the trainable parameters: a built-in check that looks at the fit on the host.

Once per fit, at its start (trainable parameters in no optimizer, frozen ones in one, parameters in two groups)
and at its first optimizer step (trainable parameters that got no gradient). No device value and no read: it reads
``requires_grad`` and ``.grad is None`` only. ``check_optimizer_coverage`` turns it off (``"off"``) or makes its
findings end the fit (``"error"``).

Imports neither torch nor the reporting at module level: :mod:`~lightning_numguard.detect.registry` declares it
(``numguard explain`` reads the declaration without torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_numguard.detect.check import Check, CheckStep
from lightning_numguard.errors import NumGuardConfigError

if TYPE_CHECKING:
    from lightning_numguard.diagnose.findings import Finding

__all__ = ["OptimizerCoverage"]

_MODES = ("warn", "error")


class OptimizerCoverage(Check):
    """Optimizer coverage problems, reported once per fit (``mode="error"``: the fit raises after recording them).

    Example:
        >>> OptimizerCoverage(mode="error")
        OptimizerCoverage(mode='error')
        >>> OptimizerCoverage(mode="loud")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_numguard.errors.NumGuardConfigError: `check_optimizer_coverage` must be one of ... got 'loud'
    """

    name = "optimizer coverage"
    kind = "optimizer_coverage"
    what = "trainable parameters in no optimizer, frozen ones in one, parameters in two groups or without gradients"
    short_hint = "build the optimizer from the trainable parameters"
    hint = (
        "build the optimizer from `[p for p in model.parameters() if p.requires_grad]` and give every trainable "
        "parameter exactly one param group"
    )
    advisory = True
    _builtin: ClassVar[bool] = True

    def __init__(self, mode: str = "warn") -> None:
        if mode not in _MODES:
            raise NumGuardConfigError(
                f"`check_optimizer_coverage` must be one of ['off', *{list(_MODES)}], got {mode!r}"
            )
        self.mode = mode
        self.fatal = mode == "error"

    @classmethod
    def for_fit(cls, config: Any) -> OptimizerCoverage | None:
        mode = config.check_optimizer_coverage
        return None if mode == "off" else cls(mode)

    def at_fit_start(self, step: CheckStep) -> list[Finding]:
        """Trainable parameters in no optimizer, frozen ones in one, parameters in two groups."""
        from lightning_numguard.detect.coverage import check_coverage

        problems = check_coverage(step.loop.module, step.loop.optimizers).problems()
        return [_finding(code, names) for code, names in problems]

    def at_first_optimizer_step(self, step: CheckStep) -> list[Finding]:
        """Trainable parameters of the optimizer about to step that got no gradient."""
        from lightning_numguard.detect.coverage import NO_GRAD_IN_FIRST_STEP, never_got_grad

        params = [p for g in step.optimizer.param_groups for p in g["params"]]
        missing = never_got_grad(step.loop.module, params)
        return [_finding(NO_GRAD_IN_FIRST_STEP, missing)] if missing else []

    def message(self, where: str, details: Mapping[str, Any], at: str) -> str:
        return f"{details.get('problem', 'optimizer coverage problem')}: {where}"


def _finding(code: str, names: list[str]) -> Finding:
    from lightning_numguard.diagnose.findings import Finding
    from lightning_numguard.reporting.hints import coverage_problem

    problem, hint = coverage_problem(code)
    return Finding("optimizer_coverage", names, {"problem": problem, "hint": hint, "code": code})
