"""Device ops the spike statistics dispatch per training step (issue 25's budget: at most 4).

Counts the aten ops dispatched (views excluded) inside :meth:`SpikeGuard.extras` and :meth:`SpikeGuard.push`, the
statistics' whole per-step work, over steps 10-29 of a real fit (one process, ``spike_action="skip"``, the headroom
check off: it is the overflow check's, not the statistics'), with a ``TorchDispatchMode``.

Usage: ``python -m benchmarks.spike_ops``
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytorch_lightning as pl
from torch.utils._python_dispatch import TorchDispatchMode

from instruments.faults import FaultData, FaultModel, loader, quiet_trainer
from lightning_numguard import NumGuardCallback
from lightning_numguard.detect import spike_guard as _spike

FIRST, LAST = 10, 30


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func.__name__ not in ("detach.default",):
            self.ops[str(func.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count() -> tuple[float, Counter[str]]:
    ops = Ops()
    step = {"now": 0}
    originals = {name: getattr(_spike.SpikeGuard, name) for name in ("extras", "push")}

    def counted(name: str) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if FIRST <= step["now"] < LAST:
                with ops:
                    return originals[name](self, *args, **kwargs)
            return originals[name](self, *args, **kwargs)

        return run

    class Step(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            step["now"] = trainer.global_step

    for name in originals:
        setattr(_spike.SpikeGuard, name, counted(name))
    try:
        guard = NumGuardCallback(spike_action="skip", emit_warnings=False, spikes={"overflow_headroom": None})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quiet_trainer([Step(), guard], max_steps=LAST + 2).fit(FaultModel(), loader(FaultData(n=400)))
    finally:
        for name, fn in originals.items():
            setattr(_spike.SpikeGuard, name, fn)
    return sum(ops.ops.values()) / (LAST - FIRST), ops.ops


if __name__ == "__main__":
    per_step, ops = count()
    print(f"spike statistics: {per_step:.2f} dispatched ops per step (steps {FIRST}-{LAST - 1})")
    for name, n in ops.most_common():
        print(f"  {name}: {n}")
