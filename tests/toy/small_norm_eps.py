"""A check of our own that looks at the fit once, on the host: normalisation layers whose ``eps`` is too small.

A LayerNorm or BatchNorm with ``eps=0`` divides by a zero std as soon as a row (or channel) is constant: the first
NaN of the run waits for that batch. Nothing here needs a device value: the module's attributes tell at fit start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_numguard import Check, CheckStep, Finding, NumGuardConfigError


class SmallNormEps(Check):
    """Every normalisation layer whose ``eps`` is below ``min_eps``; ``fatal=True`` ends the fit on one."""

    name = "normalisation eps"
    kind = "small_norm_eps"
    what = "a normalisation layer's `eps` below `min_eps`"
    short_hint = "raise its eps"
    hint = "a constant row or channel divides by a zero std there: give the layer eps >= 1e-6"
    advisory = True

    def __init__(self, min_eps: float = 1e-6, fatal: bool = False) -> None:
        if not min_eps > 0:
            raise NumGuardConfigError(f"SmallNormEps(min_eps=...) must be > 0, got {min_eps!r}")
        self.min_eps = min_eps
        self.fatal = fatal

    def at_fit_start(self, step: CheckStep) -> list[Finding]:
        norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
        small = {
            name: float(m.eps)
            for name, m in step.module.named_modules()
            if isinstance(m, norms) and float(m.eps) < self.min_eps
        }
        return [Finding(self.kind, sorted(small), {"eps": small, "min_eps": self.min_eps})] if small else []

    def message(self, where: str, details: Mapping[str, Any], at: str) -> str:
        return f"normalisation layers with eps below {self.min_eps:g}: {where} {at}"
