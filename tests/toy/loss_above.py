"""A check of our own, in one file: the loss above a threshold (``ARCHITECTURE.md``, "Adding a check").

Everything the guard needs to know about it is here: its kind, causal place, hint and sentence, where it records,
the one-element device value it folds into the step's packed read, and how its findings are built after a hit.
Its arguments are its constructor's, validated there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_numguard import Check, CheckStep, NumGuardConfigError
from lightning_numguard.diagnose.findings import Finding


class LossAbove(Check):
    """The loss of a step above ``threshold`` (finite, but outside the range this run expects)."""

    name = "loss above a threshold"
    kind = "loss_above"
    what = "the loss, finite but above `threshold`"
    short_hint = "look at this batch"
    hint = "the loss left the range this run expects: look at this batch, and lower the learning rate if it repeats"
    records_at = "loss"
    after = "nonfinite_loss"
    placeholder = "loss"

    def __init__(self, threshold: float = 10.0, advisory: bool = False) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise NumGuardConfigError(f"LossAbove: `threshold` must be a positive number, got {threshold!r}")
        self.threshold = float(threshold)
        self.advisory = advisory

    def record(self, step: CheckStep) -> torch.Tensor | None:
        assert step.loss is not None
        return step.loss.detach() > self.threshold  # one comparison on the device; no host read

    def findings(self, step: CheckStep) -> list[Finding]:
        assert step.loss is not None
        return [Finding(self.kind, ["loss"], {"value": float(step.loss), "threshold": self.threshold})]

    def message(self, where: str, details: Mapping[str, Any], at: str) -> str:
        value = details.get("value")
        said = f"the loss was {value:.4g}" if isinstance(value, float) else "the loss was"
        return f"{said} above the threshold {self.threshold:g} {at}"
