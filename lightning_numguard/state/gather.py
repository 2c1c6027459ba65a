"""Sharded snapshots: split across data-parallel ranks (and gathered back), or already sharded (DTensors).

Under data parallelism (:attr:`Loop.replicated <lightning_numguard.engine.loop.Loop.replicated>`: Lightning's
``DDPStrategy`` and its spawn/find-unused variants, Fabric's DDP, a plain ``DistributedDataParallel``), every rank
holds the same parameters and optimizer state, so each keeps only its ``1/world`` slice
(:func:`~lightning_numguard.state.snapshot.capture` with ``shard_among``). Loops whose state is already
partitioned (FSDP, DeepSpeed ZeRO) and single-process runs keep full snapshots.

The gather goes through the loop's ``all_gather`` (one all-gather on its process group): every rank's slices are
packed into one byte vector (so any dtype, ``bool`` included, travels bitwise, in one collective), moved to the
group's root device (the CPU for gloo, the rank's GPU for NCCL) and back.

When the state is ``DTensor`` local shards (FSDP2, tensor parallel) a snapshot holds each rank's local shards
(``dtensor.py``; ``Snapshot.specs`` says which), is never re-sharded, and :func:`swap_local_shards` rebuilds a
checkpoint's state through the loop's own state dicts.
"""

from __future__ import annotations

from typing import Any

from lightning_numguard.engine.loop import Loop
from lightning_numguard.state.sharding import pack, unpack
from lightning_numguard.state.snapshot import Snapshot, capture, restore, unsharded
from lightning_numguard.tree import clone_tree

__all__ = ["gather_snapshot", "shard_among", "swap_local_shards"]


def shard_among(loop: Loop, sharding: str) -> tuple[int, int] | None:
    """``(rank, world)`` when snapshots are to be sharded, else ``None`` (the same answer on every rank)."""
    if sharding == "off" or not loop.replicated:
        return None
    return loop.rank, loop.world_size


def gather_snapshot(loop: Loop, snapshot: Snapshot) -> Snapshot:
    """The whole snapshot on every rank (collective when ``snapshot`` is sharded: every rank must call it)."""
    if snapshot.sharded is None:
        return snapshot
    mine = pack(snapshot.sharded).to(loop.root_device)
    gathered = loop.all_gather(mine)
    return unsharded(snapshot, unpack(snapshot.sharded, gathered))


def swap_local_shards(loop: Loop, snapshot: Snapshot, checkpoint: dict[str, Any]) -> None:
    """Put ``snapshot``'s state into ``checkpoint`` in the strategy's own format (collective: every rank calls it).

    A snapshot of local shards cannot be written into a checkpoint as it is: the strategy's state dicts are
    sharded DTensors keyed by parameter name (a distributed checkpoint), or whole tensors on rank 0. So
    the live local shards are copied aside (no collective), the snapshot is restored in place, the loop builds
    the state dicts as its own checkpoint does (:meth:`Loop.checkpoint_states
    <lightning_numguard.engine.loop.Loop.checkpoint_states>`, copied, as they may alias the live tensors), and the
    live shards are put back: training goes on from where it was, and the next step's check sees what it would have
    seen. Only after a hit, once per poisoned checkpoint.
    """
    module, optimizers = loop.module, loop.optimizers
    live = capture(module, optimizers, step=loop.step, where="device")
    restore(snapshot, module, optimizers, restore_rng=False)
    try:
        model_state, optimizer_states = loop.checkpoint_states()
        checkpoint["state_dict"] = clone_tree(model_state)
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [clone_tree(s) for s in optimizer_states]
    finally:
        restore(live, module, optimizers, restore_rng=False)
