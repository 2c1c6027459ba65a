"""Cross-rank reduce and gather, through ``trainer.strategy`` (never raw ``torch.distributed``).

Every function here is collective: every rank must call it at the same point. With one process
they return their input.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

__all__ = ["any_rank", "first_rank", "gather", "reduce_max"]


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
    return first_rank(trainer, names)[0]


def first_rank(trainer: pl.Trainer, names: list[str]) -> tuple[list[str], int]:
    """:func:`any_rank`'s union, and the lowest rank whose own ``names`` were not empty (``-1`` when none).

    Rank-local findings (a weight one rank alone made NaN) name that rank, not the lowest rank whose
    reduced flag was set: the flags of gradients are the same on every rank after DDP's all-reduce.
    """
    if trainer.world_size <= 1:
        return names, (trainer.global_rank if names else -1)
    merged: list[str] = []
    first = -1
    for rank, part in enumerate(gather(trainer, names)):
        if part and first < 0:
            first = rank
        merged.extend(n for n in part if n not in merged)
    return merged, first
