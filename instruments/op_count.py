"""How many kernel-launching ops the guard adds to a training step, counted at the dispatcher, by check.

    python -m benchmarks.op_count [--models mlp,lm] [--variant numguard_default] [--write docs/performance.md]

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` counts every aten op that reaches the dispatcher during
steps ``FIRST``..``LAST - 1`` (batch start to batch end) of one fit per model: once with a plain ``Trainer``
(``baseline``) and once with the guard. Views and metadata-only ops (``is_view``, ``empty*``, ``detach``, ``alias``,
``lift_fresh``, ``set_``, the host read ``_local_scalar_dense``) launch no kernel and are left out; every other op
is one kernel launch on an accelerator (a ``_foreach_*`` op counts once: on CUDA it is one multi-tensor launch per
chunk of tensors). Each op the guard causes is attributed to the check whose code issued it, from the innermost
``lightning_numguard`` frame on the stack (:data:`CHECK_OF`). Unlike a step time, the count does not move with the
machine's load; ``tests/doors/trainer/test_op_budget.py`` keeps it within :data:`BUDGET` on both models.

``--write FILE`` replaces the table between ``<!-- op_count -->`` and ``<!-- /op_count -->`` in ``FILE``.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from instruments import bench_models
from instruments.bench_models import bench_trainer, quiet
from instruments.markdown import replace_block
from lightning_numguard.callbacks import NumGuardCallback

__all__ = ["BUDGET", "CHECK_OF", "FIRST", "LAST", "SPIKE_BUDGET", "count_ops", "main"]

FIRST, LAST = 10, 30
#: the most kernel-launching ops the defaults may add to a step, spike statistics included
BUDGET = 16
#: of which the spike statistics' share (issue 26)
SPIKE_BUDGET = 4

#: the op guard's frames that run the model's own op (its ops are the model's, not the guard's)
_PASS_THROUGH = frozenset({"OpGuard.call", "OpGuard._run", "_wrap.<locals>.guarded"})
#: the package's shared building blocks: their ops belong to the check that called them
_LIBRARY = frozenset({"lightning_numguard._compat", "lightning_numguard.detect.checks", "lightning_numguard.dtensor"})
RAW = bool(os.environ.get("OP_COUNT_RAW"))  # attribute to ``module:function:line`` instead of checks

_NO_KERNEL = frozenset(
    {"empty", "empty_like", "empty_strided", "detach", "alias", "lift_fresh", "set_", "_local_scalar_dense"}
)

#: ``module suffix[:function]`` of the innermost package frame -> the check its ops belong to (first match wins)
CHECK_OF: tuple[tuple[str, str], ...] = (
    ("detect.spike:global_norm", "gradients + state (norm total)"),
    ("detect.spike:tensor_norms", "gradients + state (norm total)"),
    ("detect.extra", "checks of one's own (extra_checks)"),  # with the spike window on, the grads' check
    ("detect.spike_guard", "spikes"),
    ("detect.spike", "spikes"),
    ("detect.watch", "outputs"),
    ("detect.opguard", "op domains"),
    ("engine.read:StepRead.slot_values.inputs", "inputs"),
    ("engine.read:StepRead.slot_values.suspicious", "suspicious inputs"),
    ("engine.read:StepRead.slot_values.loss", "loss"),
    ("engine.read:StepRead._loss_total", "loss"),
    ("engine.record:StepRecorder.begin", "inputs"),
    ("engine.record:StepRecorder.record_loss", "loss"),
    ("engine.record", "step record (buffers, RNG)"),
    ("engine.read:StepRead.norm_total", "gradients + state (norm total)"),
    ("detect.flags", "packing + read"),
    ("engine.read", "packing + read"),
    ("engine.group", "packing + read"),
    ("engine.deferred", "deferred read"),
    ("engine.pending", "deferred read"),
    ("state.recovery", "recovery"),
    ("state.snapshots", "snapshots"),
    ("state.snapshot", "snapshots"),
)


def _check_of(module: str, function: str) -> str:
    for prefix, check in CHECK_OF:
        mod, _, func = prefix.partition(":")
        if (module.endswith(mod) or f".{mod}." in f"{module}.") and function.startswith(func):
            return check
    return f"other ({module.rsplit('.', 1)[-1]}:{function})"


class OpCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops while ``on``: in total, by op name, and by the guard's check."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.total = 0
        self.by_op: collections.Counter[str] = collections.Counter()
        self.by_check: collections.Counter[str] = collections.Counter()
        self.by_check_op: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on and not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            name = func.overloadpacket.__name__
            self.total += 1
            self.by_op[name] += 1
            check = _caller_check()
            if check is not None:
                self.by_check[check] += 1
                self.by_check_op[(check, name)] += 1
        return func(*args, **(kwargs or {}))


def _caller_check() -> str | None:
    """The check of the innermost ``lightning_numguard`` frame on the stack, or ``None`` (not the guard's op)."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("lightning_numguard") and module not in _LIBRARY:
            function = frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname") else frame.f_code.co_name
            if function in _PASS_THROUGH and _line(frame).startswith("return func("):
                return None  # the op guard running the model's own op
            if RAW:
                return f"{module}:{function}:{frame.f_lineno}"
            if module.endswith("engine.read") and function == "StepRead.slot_values":
                function += "." + _slot_of_line(frame)
            return _check_of(module, function)
        frame = frame.f_back
    return None


def _line(frame: Any) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


def _slot_of_line(frame: Any) -> str:
    """Which slot a line of ``StepRead.slot_values`` computes (by the source line's text)."""
    line = _line(frame)
    for word, slot in (("suspicious", "suspicious"), ("max_abs_input", "suspicious"), ("input", "inputs")):
        if word in line:
            return slot
    return "loss" if "loss" in line else "pack"


class _CheckFirst(Callback):
    """Makes the guard's op guard check every guarded call before it runs, as it does on an accelerator (on the CPU it
    runs the call first and checks it only when the kernel raised: ``docs/performance.md``)."""

    def __init__(self, guard: NumGuardCallback) -> None:
        self.guard = guard

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        opguard = self.guard._pipeline.recorder.opguard  # benchmark code: the guard's own part, set as on a GPU
        if opguard is not None:
            opguard.check_cpu_calls = True


class _Window(Callback):
    """Switches the counter on for the steps from ``FIRST`` on, batch start to batch end (first callback in, last
    out)."""

    def __init__(self, counter: OpCounter, start: bool) -> None:
        self.counter, self.start = counter, start

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.start:
            self.counter.on = trainer.global_step >= FIRST

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.start:
            self.counter.on = False


def count_ops(
    model: str, guard_kwargs: dict[str, Any] | None, check_first: bool = False, last: int = LAST
) -> OpCounter:
    """One fit of ``last`` steps of ``model`` (``guard_kwargs=None``: no guard); the ops of steps FIRST..last-1.
    ``check_first``: the op guard checks each guarded call first, as on an accelerator."""
    spec = bench_models.build(model, last)
    spec.reset()
    torch.manual_seed(1234)
    counter = OpCounter()
    with tempfile.TemporaryDirectory(prefix="numguard-ops-") as tmp:
        guard = [] if guard_kwargs is None else [NumGuardCallback(dirpath=str(Path(tmp) / "ng"), **guard_kwargs)]
        trainer = bench_trainer(
            tmp,
            last,
            [
                _Window(counter, True),
                *guard,
                *([_CheckFirst(guard[0])] if guard and check_first else []),
                _Window(counter, False),
            ],
        )
        with counter:
            trainer.fit(spec.module, train_dataloaders=bench_models.dataloader(spec))
    return counter


def per_step(n: int) -> float:
    return n / (LAST - FIRST)


def table(models: list[str], guard_kwargs: dict[str, Any]) -> str:
    """The markdown table: ops per step without and with the guard, and the guard's ops by check and op; for each
    model as it runs here (CPU) and with the op guard checking first, as on an accelerator."""
    columns = [(m, first) for m in models for first in (False, True)]
    plain = {m: count_ops(m, None) for m in models}
    guarded = {(m, first): count_ops(m, guard_kwargs, first) for m, first in columns}
    checks = sorted({c for g in guarded.values() for c in g.by_check}, key=lambda c: (c == "spikes", c))
    names = [f"{m}, ops checked first" if first else m for m, first in columns]
    head = "| | " + " | ".join(names) + " |\n|---|" + "---:|" * len(columns) + "\n"
    rows = [
        "| plain `Trainer`, ops per step | " + " | ".join(f"{per_step(plain[m].total):g}" for m, _ in columns) + " |",
        "| with the guard | " + " | ".join(f"{per_step(guarded[c].total):g}" for c in columns) + " |",
    ]
    for check in checks:
        cells = []
        for c in columns:
            ops = sorted(((n, k) for (ch, k), n in guarded[c].by_check_op.items() if ch == check), reverse=True)
            detail = ", ".join(f"`{k}` {per_step(n):g}" for n, k in ops)
            cells.append(f"{per_step(guarded[c].by_check[check]):g} ({detail})" if ops else "0")
        rows.append(f"| — {check} | " + " | ".join(cells) + " |")
    added = {c: sum(guarded[c].by_check.values()) for c in columns}
    spike = {c: guarded[c].by_check["spikes"] for c in columns}
    rows.append("| **the guard's ops per step** | " + " | ".join(f"**{per_step(added[c]):g}**" for c in columns) + " |")
    rows.append(
        "| of which not the spike statistics | "
        + " | ".join(f"{per_step(added[c] - spike[c]):g}" for c in columns)
        + " |"
    )
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,lm")
    p.add_argument("--deferred", action="store_true", help='count sync_mode="deferred" instead of the defaults')
    p.add_argument("--write", default=None, help="replace the table between the op_count markers in this file")
    args = p.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    kwargs: dict[str, Any] = {"sync_mode": "deferred"} if args.deferred else {}
    out = table(args.models.split(","), kwargs)
    print(out)
    if args.write:
        replace_block(args.write, "op_count", out)


if __name__ == "__main__":
    main()
