"""Sharded snapshots: split across data-parallel ranks (and gathered back), or already sharded (DTensors).

Under a data-parallel strategy (Lightning's ``DDPStrategy`` and its spawn/find-unused variants),
every rank holds the same parameters and optimizer state, so each keeps only its ``1/world`` slice
(:func:`~lightning_numguard.state.snapshot.capture` with ``shard_among``). Strategies that already
partition the state (FSDP, DeepSpeed ZeRO, which subclasses ``DDPStrategy``) and single-process
runs keep full snapshots.

The gather goes through ``trainer.strategy.all_gather`` (a public Lightning API; on DDP it is one
``torch.distributed`` all-gather on the strategy's process group): every rank's slices are packed
into one byte vector (so any dtype, ``bool`` included, travels bitwise, in one collective), moved
to the strategy's root device (the CPU for gloo, the rank's GPU for NCCL) and back.

Under ``ModelParallelStrategy`` (FSDP2, tensor parallel) the state is already sharded: a snapshot holds
each rank's local shards (``core/dtensor.py``; ``Snapshot.specs`` says which), is never re-sharded, and
:func:`swap_local_shards` rebuilds a checkpoint's state through the strategy's own state-dict calls.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_numguard.state.sharding import pack, unpack
from lightning_numguard.state.snapshot import Snapshot, capture, restore, unsharded
from lightning_numguard.tree import clone_tree

__all__ = ["SHARDING", "gather_snapshot", "shard_among", "swap_local_shards"]

SHARDING = ("auto", "off")


def shard_among(trainer: pl.Trainer, sharding: str) -> tuple[int, int] | None:
    """``(rank, world)`` when snapshots are to be sharded, else ``None`` (the same answer on every rank)."""
    if sharding == "off" or trainer.world_size <= 1:
        return None
    strategy = trainer.strategy
    if not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy):
        return None
    return trainer.global_rank, trainer.world_size


def gather_snapshot(trainer: pl.Trainer, snapshot: Snapshot) -> Snapshot:
    """The whole snapshot on every rank (collective when ``snapshot`` is sharded: every rank must call it)."""
    if snapshot.sharded is None:
        return snapshot
    mine = pack(snapshot.sharded).to(trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(mine)
    return unsharded(snapshot, unpack(snapshot.sharded, gathered))


def swap_local_shards(
    trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot, checkpoint: dict[str, Any]
) -> None:
    """Put ``snapshot``'s state into ``checkpoint`` in the strategy's own format (collective: every rank calls it).

    A snapshot of local shards cannot be written into a checkpoint as it is: the strategy's state dicts are
    sharded DTensors keyed by parameter name (a distributed checkpoint), or whole tensors on rank 0. So
    the live local shards are copied aside (no collective), the snapshot is restored in place, the strategy
    builds the state dicts as :meth:`~pytorch_lightning.Trainer.save_checkpoint` does (copied, as they may
    alias the live tensors), and the live shards are put back: training goes on from where it was, and the
    next step's check sees what it would have seen. Only after a hit, once per poisoned checkpoint.
    """
    optimizers = trainer.optimizers
    live = capture(pl_module, optimizers, step=trainer.global_step, where="device")
    restore(snapshot, pl_module, optimizers, restore_rng=False)
    try:
        strategy = trainer.strategy
        checkpoint["state_dict"] = clone_tree(strategy.lightning_module_state_dict())
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [clone_tree(strategy.optimizer_state(o)) for o in optimizers]
    finally:
        restore(live, pl_module, optimizers, restore_rng=False)
