"""Cross-rank reduce and gather, through ``trainer.strategy`` (never raw ``torch.distributed``).

Every function here is collective: every rank must call it at the same point. With one process
they return their input.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

__all__ = ["any_rank", "gather", "reduce_max"]


def reduce_max(trainer: pl.Trainer, packed: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of ``packed`` over ranks (one all-reduce)."""
    if trainer.world_size <= 1:
        return packed
    return trainer.strategy.reduce(packed, reduce_op="max")


def gather(trainer: pl.Trainer, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (one object broadcast per rank; only after a hit).

    Lightning strategies have no ``all_gather_object``; their ``broadcast`` takes any picklable object.
    """
    if trainer.world_size <= 1:
        return [obj]
    return [trainer.strategy.broadcast(obj, src=src) for src in range(trainer.world_size)]


def any_rank(trainer: pl.Trainer, names: list[str]) -> list[str]:
    """The union of every rank's ``names``, in rank order: empty only if no rank found anything."""
    if trainer.world_size <= 1:
        return names
    merged: list[str] = []
    for part in gather(trainer, names):
        merged.extend(n for n in part if n not in merged)
    return merged
