"""Cross-rank reduce and gather through the loop's process group (:class:`~lightning_numguard.engine.loop.Loop`).

Every function here is collective: every rank must call it at the same point. With one process
they return their input.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_numguard.engine.loop import Loop

__all__ = ["any_rank", "first_rank", "gather", "reduce_max"]


def reduce_max(loop: Loop, packed: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of ``packed`` over ranks (one all-reduce)."""
    if loop.world_size <= 1:
        return packed
    return loop.reduce_max(packed)


def gather(loop: Loop, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (one object broadcast per rank; only after a hit)."""
    if loop.world_size <= 1:
        return [obj]
    return [loop.broadcast(obj, src) for src in range(loop.world_size)]


def any_rank(loop: Loop, names: list[str]) -> list[str]:
    """The union of every rank's ``names``, in rank order: empty only if no rank found anything."""
    return first_rank(loop, names)[0]


def first_rank(loop: Loop, names: list[str]) -> tuple[list[str], int]:
    """:func:`any_rank`'s union, and the lowest rank whose own ``names`` were not empty (``-1`` when none).

    Rank-local findings (a weight one rank alone made NaN) name that rank, not the lowest rank whose
    reduced flag was set: the flags of gradients are the same on every rank after DDP's all-reduce.
    """
    if loop.world_size <= 1:
        return names, (loop.rank if names else -1)
    merged: list[str] = []
    first = -1
    for rank, part in enumerate(gather(loop, names)):
        if part and first < 0:
            first = rank
        merged.extend(n for n in part if n not in merged)
    return merged, first
