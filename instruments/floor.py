"""The floor: the least any callback can do to check what the guard checks, with none of its machinery.

:class:`FloorGuard` reads every value the guard's defaults read (the batch's floating inputs, the output of each
block the guard's watch selects, the loss, every gradient, the floating buffers) once, in the cheapest form known
on the device (``core.checks.TotalPlan``: a float32 ``sum`` of each large CPU tensor, one fused call for the small
ones, the parameters and optimizer state included), and reads one vector back per step. It names nothing, keeps no
record, takes no snapshot and cannot roll back: after a non-finite value it only drops the step's gradients. With
``every=True`` it also reads the parameters and the optimizer state every step, as ``check`` with every entry does;
with ``outputs=False`` it reads no block output (no forward hook), the reference for what reading them costs.

Timed in the same interleaved rounds as the guard, its ratio to the baseline is what the bytes and the hooks cost
on this machine; the guard's ratio minus the floor's is what the guard's machinery (attribution, records, the op
guard, the policy) adds. The floor leaves out the op guard's domain checks (timed on their own by
``benchmarks.opguard_cost``). A floor at or above a target means that a callback reading these values every step,
in these forms, cannot meet it (see ``docs/performance.md``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from pytorch_lightning.callbacks import Callback

from lightning_numguard.detect.checks import TotalPlan, norm_total
from lightning_numguard.detect.watch import select_modules
from lightning_numguard.tree import floating_leaves

__all__ = ["FloorGuard"]


class _SumHook:
    """Forward hook: the output's float32 sum, kept for the step's read.

    A sum is the cheapest full read (about half an ``aminmax``'s time on a CPU); unlike the guard's ``aminmax`` it
    gives no range and can overflow into a false candidate, which a floor need not care about.
    """

    __slots__ = ("guard",)

    def __init__(self, guard: FloorGuard) -> None:
        self.guard = guard

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        t0 = time.thread_time()
        if isinstance(output, torch.Tensor) and output.is_floating_point() and torch.is_grad_enabled():
            self.guard._outputs.append(output.detach().sum(dtype=torch.float32))
        self.guard._spent += time.thread_time() - t0


class FloorGuard(Callback):
    """A callback that only reads what the guard reads, once, with one host read per step (benchmark floor).

    Attributes:
        step_hook_ms: per step, the thread CPU time spent inside this callback's own hooks (forward hooks included),
            in ms: what its reads cost the training thread, without what they cost indirectly (caches, allocator).
    """

    def __init__(self, every: bool = False, outputs: bool = True) -> None:
        self.every = every
        self.outputs = outputs
        self.bad_steps = 0
        self._outputs: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self._inputs: list[torch.Tensor] = []
        self._loss: torch.Tensor | None = None
        self._buffers: list[torch.Tensor] = []
        self._buffer_plan = TotalPlan([])
        self._plans: dict[int, tuple[list[torch.Tensor], TotalPlan]] = {}
        self._state: tuple[int, list[torch.Tensor], TotalPlan] | None = None  # the optimizer state (every=True)
        self._device = torch.device("cpu")
        self.step_hook_ms: list[float] = []
        self._spent = 0.0  # this step's hook time so far (s)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        blocks = select_modules(pl_module, depth=1)  # the blocks the guard's default watch hooks
        self._buffers = [b for b in pl_module.buffers() if b.is_floating_point() and b.numel()]
        self._buffer_plan = TotalPlan(self._buffers)
        self._device = pl_module.device
        for _, module in blocks if self.outputs else ():
            self._handles.append(module.register_forward_hook(_SumHook(self)))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        t0 = time.thread_time()
        self._inputs = [t.sum(dtype=torch.float32) for _, t in floating_leaves(batch)]
        self._spent = time.thread_time() - t0  # a new step

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        t0 = time.thread_time()
        self._loss = loss.detach()
        self._spent += time.thread_time() - t0

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        t0 = time.thread_time()
        self._check(optimizer)
        self._spent += time.thread_time() - t0
        self.step_hook_ms.append(self._spent * 1e3)

    def _check(self, optimizer: Any) -> None:
        # Every read goes through the guard's own cheapest form (checks.TotalPlan: a float32 sum per large CPU
        # tensor, the GradScaler's fused check for the small ones), rewriting the same bits back even in the state,
        # which the guard does only while no snapshot copies it on another thread.
        device = self._device
        cached = self._plans.get(id(optimizer))
        if cached is None:  # once per optimizer: its trainable parameters and their grouping
            params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            cached = self._plans[id(optimizer)] = (params, TotalPlan(params))
        params, plan = cached
        grads = [p.grad for p in params]
        if any(g is None for g in grads):  # a parameter without a gradient this step: no plan
            present = [g for g in grads if g is not None]
            parts = [norm_total(present, device, rewritable=True)] if present else []
        else:
            parts = [plan.total(grads, device, rewritable=True)]
        parts += self._inputs + self._outputs
        self._outputs = []
        if self._loss is not None:
            parts.append(self._loss)
        if self._buffers:
            parts.append(self._buffer_plan.total(self._buffers, device, rewritable=True))
        if self.every:
            parts.append(plan.total(params, device, rewritable=True))
            if self._state is None or self._state[0] != len(optimizer.state):  # the state exists after a first step
                state = [v for p in params for v in optimizer.state.get(p, {}).values()]
                state = [v for v in state if torch.is_tensor(v) and v.is_floating_point() and v.dim()]
                self._state = (len(optimizer.state), state, TotalPlan(state))
            if self._state[1]:
                parts.append(self._state[2].total(self._state[1], device, rewritable=True))
        values = torch.stack([v if v.dtype == torch.float32 else v.float() for v in parts])
        if not all(map(math.isfinite, values.tolist())):  # the one host read of the step
            self.bad_steps += 1
            optimizer.zero_grad(set_to_none=True)
