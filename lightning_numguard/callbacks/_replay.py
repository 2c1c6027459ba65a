"""Lightning glue for the replay: re-run ``training_step`` on a bad batch, quietly, on this rank only.

The search itself (first module, forward op and autograd node) is :func:`lightning_numguard.core.replay.replay`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl

from lightning_numguard.core.replay import replay

__all__ = ["replay_batch"]


@contextlib.contextmanager
def _quiet_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """Keep ``self.log`` calls of the replayed ``training_step`` out of the run's metrics."""
    saved = {name: pl_module.__dict__.get(name) for name in ("log", "log_dict")}
    pl_module.log = lambda *a, **k: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                pl_module.__dict__.pop(name, None)
            else:
                pl_module.__dict__[name] = value


def replay_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, rng: dict[str, Any] | None
) -> dict[str, Any]:
    """Replay ``batch`` from the current weights; see :func:`~lightning_numguard.core.replay.replay`.

    Gradients are not synchronised across ranks (``no_sync``): only this rank replays.
    """
    no_sync = getattr(trainer.strategy.model, "no_sync", None)
    with no_sync() if callable(no_sync) else contextlib.nullcontext(), _quiet_logging(pl_module):
        return replay(pl_module, lambda: pl_module.training_step(batch, batch_idx), rng)
