"""Snapshots sharded across data-parallel ranks: when to shard, and the collective gather back.

Under a data-parallel strategy (Lightning's ``DDPStrategy`` and its spawn/find-unused variants),
every rank holds the same parameters and optimizer state, so each keeps only its ``1/world`` slice
(:func:`~lightning_numguard.core.snapshot.capture` with ``shard_among``). Strategies that already
partition the state (FSDP, DeepSpeed ZeRO, which subclasses ``DDPStrategy``) and single-process
runs keep full snapshots.

The gather goes through ``trainer.strategy.all_gather`` (a public Lightning API; on DDP it is one
``torch.distributed`` all-gather on the strategy's process group): every rank's slices are packed
into one byte vector (so any dtype, ``bool`` included, travels bitwise, in one collective), moved
to the strategy's root device (the CPU for gloo, the rank's GPU for NCCL) and back.
"""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_numguard.core.sharding import pack, unpack
from lightning_numguard.core.snapshot import Snapshot, unsharded

__all__ = ["SHARDING", "gather_snapshot", "shard_among"]

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
