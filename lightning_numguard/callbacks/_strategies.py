"""Which strategies the guard supports, said at setup: never silent wrong behaviour.

========================================  ==========================================================
strategy                                  what the guard does
========================================  ==========================================================
single device, DDP (``ddp``,              everything: checks, one all-reduced read, skip, rollback,
``ddp_spawn``, ``ddp_notebook``)          halt, ``last_finite.ckpt``
FSDP, ``ModelParallelStrategy``,          refused (``NumGuardError``) unless ``action="warn"``: a
DeepSpeed (sharded state)                 snapshot of ``state_dict()`` would gather or miss the shards
                                          and a rollback could not put them back in place; under
                                          ``"warn"`` the per-rank checks run and nothing is restored
any other strategy                        a warning: the checks run, recovery is untested there
========================================  ==========================================================

The design of per-rank snapshots for sharded strategies is in ``docs/strategies.md``.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_numguard.errors import NumGuardError, NumGuardWarning

__all__ = ["SHARDED", "SUPPORTED", "check_strategy"]

#: Strategy classes (by name, anywhere in the MRO) whose state is sharded across ranks.
SHARDED = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")
#: Strategy classes the guard is tested with.
SUPPORTED = ("SingleDeviceStrategy", "DDPStrategy")


def check_strategy(strategy: Any, action: str) -> None:
    """Raise for a sharded strategy under an acting ``action``; warn for a strategy never tested.

    Matched by class name in the MRO so that optional packages (DeepSpeed) need not be importable.
    """
    mro = [cls.__name__ for cls in type(strategy).__mro__]
    name = type(strategy).__name__
    sharded = next((s for s in SHARDED if s in mro), None)
    if sharded is not None:
        if action != "warn":
            raise NumGuardError(
                f"NumGuard: action={action!r} is not supported under {name} (sharded state): a snapshot of "
                "the sharded parameters and optimizer state cannot yet be restored in place, so a skip or "
                "rollback could silently corrupt the run. Use action='warn' (inputs, loss, gradients and "
                "local shards are checked on every rank; nothing is restored), or DDP. See docs/strategies.md."
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
