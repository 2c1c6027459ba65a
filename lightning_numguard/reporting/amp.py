"""fp16 AMP: the GradScaler's own overflow skips and its loss scale, on the loggers; a collapsing scale said once.

Under a real ``GradScaler`` the guard counts the steps the scaler skipped itself (non-finite gradients
with finite inputs, loss and state: its normal back-off) and writes ``numguard/amp_overflow_steps`` and
``numguard/loss_scale`` to the loggers on the loop's logging steps, at its step number, as the guard's other series
(:mod:`~lightning_numguard.reporting.series`): the scale is read there, on a logging step only (the loop reads its
own metrics there too).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lightning_numguard import _compat
from lightning_numguard.engine.loop import Loop
from lightning_numguard.reporting.report import Reporter

__all__ = ["SCALE_FLOOR", "AmpCounters"]

log = logging.getLogger(__name__)

#: A loss scale below this while the gradients still overflow: fp16 overflows even unscaled.
SCALE_FLOOR = 1.0


class AmpCounters:
    """Writes the scaler's counters on the loop's logging steps and watches the scale after overflows."""

    def __init__(self) -> None:
        self.collapsed = False
        self._scaler: tuple[Loop, Any] | None = None  # the loop and its scaler, looked up once per fit

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_scaler": None}  # the loop of a running fit stays with it

    def _scaler_of(self, loop: Loop) -> Any:
        """``loop.scaler``, looked up once per loop (the precision plugin's scaler does not change in a fit)."""
        held = self._scaler
        if held is None or held[0] is not loop:
            held = self._scaler = (loop, loop.scaler)
        return held[1]

    def log(self, loop: Loop, reporter: Reporter, overflow_steps: int) -> None:
        """``numguard/amp_overflow_steps`` and ``numguard/loss_scale`` (only under a GradScaler, on logging steps)."""
        scaler = self._scaler_of(loop)
        if scaler is None or not scaler.is_enabled() or not loop.loggers or not loop.logs_due():
            return
        values = {"numguard/amp_overflow_steps": float(overflow_steps)}
        scale, _ = _compat.scaler_tensors(scaler)
        if isinstance(scale, torch.Tensor) and loop.is_zero:
            values["numguard/loss_scale"] = float(scale.detach().reshape(()))  # a logging step's read, rank 0 only
        reporter.point(loop, loop.log_step, values)

    def after_overflow(self, loop: Loop) -> str | None:
        """After an overflow step (a hit: syncing is allowed): the message once when the scale has collapsed."""
        scaler = loop.scaler
        if self.collapsed or scaler is None:
            return None
        scale = float(scaler.get_scale())
        if scale >= SCALE_FLOOR:
            return None
        self.collapsed = True
        return (
            f"the fp16 loss scale has collapsed to {scale:.3g} (below {SCALE_FLOOR:g}) and the gradients are still "
            "non-finite: they overflow fp16 even unscaled, so every step is being skipped; train in bf16-mixed or "
            "32-true, or lower the learning rate"
        )
