"""fp16 AMP: the GradScaler's own overflow skips and its loss scale, on the loggers; a collapsing scale said once.

Under a real ``GradScaler`` the guard counts the steps the scaler skipped itself (non-finite gradients
with finite inputs, loss and state: its normal back-off) and logs ``numguard/amp_overflow_steps`` and
``numguard/loss_scale`` with ``pl_module.log``: they reach the loggers every ``log_every_n_steps``, with
the user's own metrics, and the scale stays a device tensor until Lightning writes it (no extra sync).
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_numguard import _compat

__all__ = ["SCALE_FLOOR", "AmpCounters"]

log = logging.getLogger(__name__)

#: A loss scale below this while the gradients still overflow: fp16 overflows even unscaled.
SCALE_FLOOR = 1.0


def scaler_of(trainer: pl.Trainer) -> Any:
    """The precision plugin's GradScaler, or ``None``."""
    return getattr(trainer.precision_plugin, "scaler", None)


class AmpCounters:
    """Logs the scaler's counters every step (through Lightning's logging) and watches the scale after overflows."""

    def __init__(self) -> None:
        self.collapsed = False

    def log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, overflow_steps: int) -> None:
        """``numguard/amp_overflow_steps`` and ``numguard/loss_scale`` (only under a GradScaler; no sync)."""
        scaler = scaler_of(trainer)
        if scaler is None or not scaler.is_enabled() or not trainer.loggers:
            return
        scale, _ = _compat.scaler_tensors(scaler)
        values: dict[str, Any] = {"numguard/amp_overflow_steps": float(overflow_steps)}
        if isinstance(scale, torch.Tensor):
            values["numguard/loss_scale"] = scale.detach().reshape(())
        pl_module.log_dict(values, on_step=True, on_epoch=False, logger=True, prog_bar=False)

    def after_overflow(self, trainer: pl.Trainer) -> str | None:
        """After an overflow step (a hit: syncing is allowed): the message once when the scale has collapsed."""
        scaler = scaler_of(trainer)
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
