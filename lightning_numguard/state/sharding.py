"""A training-state snapshot split across data-parallel ranks: each keeps 1/world, a restore gathers it.

Under data parallelism every rank holds the same weights and optimizer state, so a full host copy
per rank is ``world`` copies of the same bytes (about 12 bytes per parameter with Adam: weights and
two moments in float32). :func:`shard` flattens every tensor of a state tree into one flat vector
per dtype and keeps only this rank's contiguous ``1/world`` slice of each (on the host, or on the
device); what is not a tensor (step counters, ``param_groups``) is small and kept whole.
:func:`gather` is collective: each rank contributes its slices (one ``all_gather`` per dtype) and
gets back the whole tree, bitwise equal to the one sharded.

torch and the standard library only (``torch.distributed`` for the gather).

Example:
    >>> import torch
    >>> tree = {"w": torch.arange(5.0), "opt": [{"step": 3, "m": torch.ones(2, 2)}]}
    >>> parts = [shard(tree, rank, world=2) for rank in range(2)]
    >>> [p.nbytes for p in parts]  # 9 float32 values: 5 on rank 0, 4 on rank 1 (padded to 5)
    [20, 20]
    >>> out = unshard(parts[0], [p.local for p in parts])
    >>> torch.equal(out["w"], tree["w"]) and out["opt"][0]["step"]
    3
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ShardedState", "gather", "pack", "shard", "unpack", "unshard"]


@dataclass
class _Leaf:
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    device: torch.device


@dataclass
class ShardedState:
    """This rank's part of a state tree.

    Attributes:
        skeleton: the tree with each tensor replaced by a :class:`_Leaf` (where it lies in its
            dtype's flat vector); other leaves as they were.
        totals: per dtype, the number of elements of the flat vector (before padding).
        local: per dtype, this rank's slice (``ceil(total / world)`` elements, zero-padded).
        rank, world: who holds which slice.
    """

    skeleton: Any
    totals: dict[torch.dtype, int]
    local: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    rank: int = 0
    world: int = 1

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage this rank holds."""
        return sum(t.numel() * t.element_size() for t in self.local.values())


def _flatten(tree: Any, out: dict[torch.dtype, list[torch.Tensor]], sizes: dict[torch.dtype, int]) -> Any:
    if isinstance(tree, torch.Tensor):
        t = tree.detach()
        leaf = _Leaf(t.dtype, t.shape, sizes.get(t.dtype, 0), t.device)
        sizes[t.dtype] = leaf.offset + t.numel()
        out.setdefault(t.dtype, []).append(t.reshape(-1))
        return leaf
    if isinstance(tree, dict):
        return {k: _flatten(v, out, sizes) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_flatten(v, out, sizes) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def shard(
    tree: Any,
    rank: int,
    world: int,
    device: torch.device | str = "cpu",
    *,
    pin: bool = False,
    reuse: ShardedState | None = None,
    copies: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> ShardedState:
    """This rank's ``1/world`` of every tensor in ``tree`` (copied, on ``device``), and the tree's shape.

    Every rank must pass the same tree (data parallelism keeps the ranks' states identical).
    ``pin`` allocates host slices in pinned memory; ``reuse`` is an older state whose slices may be
    overwritten when their dtype, length and device match (a copy, not an allocation). ``copies``:
    append each ``(destination slice, source piece)`` to these two lists instead of copying (the
    caller copies them, e.g. asynchronously with :mod:`.async_copy`).
    """
    if not 0 <= rank < world:
        raise ValueError(f"`rank` must be in [0, {world}), got {rank}")
    parts: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    skeleton = _flatten(tree, parts, sizes)
    local: dict[torch.dtype, torch.Tensor] = {}
    for dtype, tensors in parts.items():
        chunk = -(-sizes[dtype] // world)
        start, stop = min(rank * chunk, sizes[dtype]), min((rank + 1) * chunk, sizes[dtype])
        old = reuse.local.get(dtype) if reuse is not None else None
        if old is not None and old.numel() == chunk and old.device == torch.device(device):
            mine = old
            mine[max(stop - start, 0) :].zero_()  # the padding
        else:
            mine = torch.zeros(chunk, dtype=dtype, device=device, pin_memory=pin and torch.device(device).type == "cpu")
        pos = 0  # copy only the pieces of each tensor that fall in [start, stop): no full flat copy
        for t in tensors:
            lo, hi = max(start, pos), min(stop, pos + t.numel())
            if lo < hi:
                src = t[lo - pos : hi - pos]  # CUDA into pinned host memory: ordered on the stream, no host stall
                if copies is not None:
                    copies[0].append(mine[lo - start : hi - start])
                    copies[1].append(src)
                else:
                    mine[lo - start : hi - start].copy_(src, non_blocking=src.is_cuda and mine.is_pinned())
            pos += t.numel()
        local[dtype] = mine
    return ShardedState(skeleton, sizes, local, rank, world)


def _rebuild(skeleton: Any, flat: dict[torch.dtype, torch.Tensor]) -> Any:
    if isinstance(skeleton, _Leaf):
        n = skeleton.shape.numel()
        piece = flat[skeleton.dtype][skeleton.offset : skeleton.offset + n]
        return piece.reshape(skeleton.shape).to(skeleton.device, copy=True)
    if isinstance(skeleton, dict):
        return {k: _rebuild(v, flat) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_rebuild(v, flat) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_rebuild(v, flat) for v in skeleton)
    return skeleton


def unshard(state: ShardedState, slices: Sequence[dict[torch.dtype, torch.Tensor]]) -> Any:
    """The whole tree from every rank's :attr:`ShardedState.local`, in rank order (no communication)."""
    flat = {dtype: torch.cat([s[dtype].cpu() for s in slices])[:total] for dtype, total in state.totals.items()}
    return _rebuild(state.skeleton, flat)


def gather(state: ShardedState, group: Any = None) -> Any:
    """The whole tree back on every rank (collective: one ``all_gather`` per dtype).

    The slices travel on the device the process group uses: pass a state sharded on the host for
    gloo, on the GPU for NCCL.
    """
    slices: list[dict[torch.dtype, torch.Tensor]] = [{} for _ in range(state.world)]
    for dtype in sorted(state.totals, key=str):  # the same order on every rank
        mine = state.local[dtype]
        parts = [torch.empty_like(mine) for _ in range(state.world)]
        dist.all_gather(parts, mine, group=group)
        for r, part in enumerate(parts):
            slices[r][dtype] = part
    return unshard(state, slices)


def pack(state: ShardedState) -> torch.Tensor:
    """This rank's slices as one byte vector (dtypes in a fixed order): the same length on every rank."""
    parts = [state.local[d].reshape(-1).view(torch.uint8) for d in sorted(state.totals, key=str)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def unpack(state: ShardedState, gathered: torch.Tensor) -> list[dict[torch.dtype, torch.Tensor]]:
    """Every rank's slices from the ``[world, n]`` stack of their :func:`pack` vectors (bitwise)."""
    out: list[dict[torch.dtype, torch.Tensor]] = []
    for row in gathered.cpu():
        slices: dict[torch.dtype, torch.Tensor] = {}
        pos = 0
        for dtype in sorted(state.totals, key=str):
            n = state.local[dtype].numel() * state.local[dtype].element_size()
            slices[dtype] = row[pos : pos + n].clone().view(dtype)
            pos += n
        out.append(slices)
    return out
