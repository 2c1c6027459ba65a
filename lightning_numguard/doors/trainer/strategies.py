"""Which strategies the guard supports, said at setup: never silent wrong behaviour.

========================================  ==========================================================
strategy                                  what the guard does
========================================  ==========================================================
single device, DDP (``ddp``,              everything: checks, one all-reduced read, skip, rollback,
``ddp_spawn``, ``ddp_notebook``)          halt, ``last_finite.ckpt``
``ModelParallelStrategy`` (FSDP2          everything, on each rank's local shards (``core/dtensor.py``):
``fully_shard``, tensor parallel, 2-D)    checks, the one all-reduced read, per-rank snapshots restored
                                          in place, ``last_finite.ckpt`` through the strategy (a
                                          distributed-checkpoint folder by default); both sync modes
``FSDPStrategy`` (FSDP1), DeepSpeed       refused (``NumGuardError``) unless ``action="warn"``: never run
                                          with the guard (Lightning 2.6 runs FSDP1 on a GPU only, and
                                          DeepSpeed is not installed); under ``"warn"`` the per-rank
                                          checks run and nothing is restored
any other strategy                        a warning: the checks run, recovery is untested there
========================================  ==========================================================

The design of per-rank snapshots for sharded strategies is in ``docs/strategies.md``.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_numguard.errors import NumGuardError, NumGuardWarning
from lightning_numguard.reporting.events import acting

__all__ = [
    "LOCAL_SHARDS",
    "SHARDED",
    "SUPPORTED",
    "UNTESTED_SHARDED",
    "check_strategy",
    "holds_local_shards",
    "replicates_state",
]

#: Strategy classes (by name, anywhere in the MRO) whose state is sharded across ranks.
SHARDED = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")
#: Sharded strategies whose state is DTensors, guarded through their local shards.
LOCAL_SHARDS = ("ModelParallelStrategy",)
#: Sharded strategies never run with the guard, and why; what to use instead.
UNTESTED_SHARDED = {
    "FSDPStrategy": (
        "Lightning 2.6 runs FSDPStrategy only on a GPU, and the guard has not been run under it: a per-rank "
        "snapshot of its use_orig_params shards restored in place, its sharded state-dict checkpoint as "
        "last_finite.ckpt and the replay under its all-gathers are untested"
    ),
    "DeepSpeedStrategy": (
        "the guard has not been run under DeepSpeed (not installed here): its ZeRO partitions of the "
        "optimizer state and its own checkpoint format are neither snapshotted nor restored"
    ),
}
#: Strategy classes the guard is tested with.
SUPPORTED = ("SingleDeviceStrategy", "DDPStrategy", *LOCAL_SHARDS)


def check_strategy(strategy: Any, action: str) -> None:
    """Raise for an untested sharded strategy under an acting ``action``; warn for a strategy never tested.

    Matched by class name in the MRO so that optional packages (DeepSpeed) need not be importable.
    """
    mro = [cls.__name__ for cls in type(strategy).__mro__]
    name = type(strategy).__name__
    untested = next((s for s in UNTESTED_SHARDED if s in mro), None)
    if untested is not None:
        if acting(action):
            raise NumGuardError(
                f"NumGuard: action={action!r} is not supported under {name}: {UNTESTED_SHARDED[untested]}, so a "
                "skip or rollback could silently corrupt the run. Use ModelParallelStrategy with "
                "torch.distributed.fsdp.fully_shard in configure_model (FSDP2: every action works there, on each "
                "rank's local shards), or action='warn' (checks only, nothing restored). See docs/strategies.md."
            )
        warnings.warn(
            f"NumGuard under {name}: checks run on each rank's local shards and the decision is all-reduced, "
            "but nothing is skipped, restored or saved (action='warn'); per-module output names refer to the "
            "wrapped modules.",
            NumGuardWarning,
            stacklevel=2,
        )
        return
    if not any(s in mro for s in SUPPORTED):
        warnings.warn(
            f"NumGuard has not been tested under {name}: the checks run, but skip, rollback and halt assume "
            "every rank holds the full model and optimizer state (as under DDP). Check a rollback in your "
            "setup before relying on it.",
            NumGuardWarning,
            stacklevel=2,
        )


def holds_local_shards(strategy: Any) -> bool:
    """Whether ``strategy`` is one whose state the guard handles as ``DTensor`` local shards (its checkpoints:
    a distributed-checkpoint folder, written by every rank)."""
    return any(cls.__name__ in LOCAL_SHARDS for cls in type(strategy).__mro__)


def replicates_state(strategy: Any) -> bool:
    """Whether every rank of ``strategy`` holds the same whole parameters and optimizer state: Lightning's
    ``DDPStrategy`` and its spawn/find-unused variants, not DeepSpeed ZeRO (which subclasses it) nor FSDP."""
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

    return isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy)
