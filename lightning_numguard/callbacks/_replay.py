"""Re-run a bad batch with full instrumentation to find the first module and autograd op.

Runs only after an incident, never on clean steps. The caller restores the training state
afterwards (the replay's forward pass changes BatchNorm buffers and leaves gradients).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_numguard.core.opguard import OpGuard

__all__ = ["replay_batch"]

log = logging.getLogger(__name__)

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)')


def _finite(obj: Any) -> bool:
    tensors = [t for t in (obj if isinstance(obj, (tuple, list)) else (obj,)) if isinstance(t, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


@contextlib.contextmanager
def _quiet_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """Keep ``self.log`` calls of the replayed ``training_step`` out of the run's metrics."""
    saved = {name: pl_module.__dict__.get(name) for name in ("log", "log_dict")}
    pl_module.log = lambda *a, **k: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                pl_module.__dict__.pop(name, None)
            else:
                pl_module.__dict__[name] = value


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_in(o)]
    return []


class _FirstBadOp(TorchFunctionMode):
    """Records the first op whose floating inputs were all finite but whose output was not (replay only)."""

    def __init__(self, current: list[str]) -> None:
        super().__init__()
        self.current = current
        self.found: tuple[str, str | None] | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is None and isinstance(out, torch.Tensor) and out.is_floating_point():
            inputs = [t for a in (*args, *(kwargs or {}).values()) for t in _tensors_in(a)]
            if not _finite(out) and all(_finite(a) for a in inputs):
                name = getattr(func, "__name__", str(func))
                self.found = (name, self.current[-1] if self.current else None)
        return out


def _graph_nodes(root: Any) -> list[Any]:
    seen: set[int] = set()
    out = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return out


def _first_bad_node(pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> dict[str, Any]:
    """Backward with a hook on every autograd node: the first whose gradients went NaN/Inf from finite ones.

    Anomaly mode's ``check_nan`` only sees NaN (``sqrt(0)``'s backward returns Inf first), so the
    graph is walked instead; anomaly mode still records each node's forward traceback.
    """
    found: dict[str, Any] = {}

    def hook(grad_inputs: Any, grad_outputs: Any, node: Any) -> None:
        if found or not _finite(grad_outputs) or _finite(grad_inputs):
            return
        found["op"] = type(node).__name__
        trace = (node.metadata or {}).get("traceback_") if hasattr(node, "metadata") else None
        if trace:
            frames = _FRAME.findall("".join(trace))
            user = [f for f in frames if "site-packages" not in f[0] and "/torch/" not in f[0]]
            if user:
                file, line, func, code = user[-1]
                found["forward_trace"] = f"{file}:{line} in {func}: {code.strip()}"

    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        loss = _loss_of(pl_module.training_step(batch, batch_idx))
        if loss is None or loss.grad_fn is None:
            return found
        handles = [
            node.register_hook(lambda gi, go, node=node: hook(gi, go, node)) for node in _graph_nodes(loss.grad_fn)
        ]
        try:
            loss.backward()
        finally:
            for h in handles:
                h.remove()
    return found


def _run(pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor | None:
    loss = _loss_of(pl_module.training_step(batch, batch_idx))
    if loss is not None and loss.requires_grad:
        loss.backward()
    return loss


def replay_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, rng: dict[str, Any] | None
) -> dict[str, Any]:
    """Replay ``batch`` from the current weights; return what went non-finite first.

    Returns a dict with, when found: ``module`` (first module, in backward order, whose
    gradient w.r.t. its inputs went non-finite while the gradient it received was finite),
    ``forward_module`` (first module whose output went non-finite), ``forward_op`` and
    ``forward_op_module`` (the first op whose finite inputs gave a non-finite output, e.g.
    ``div``, and the innermost module running it), ``op`` (the first autograd
    node whose gradients went NaN/Inf from finite incoming ones, e.g. ``SqrtBackward0``) and ``forward_trace`` (the
    user code line that created that op).
    """
    from lightning_numguard.core.snapshot import rng_state, set_rng_state

    result: dict[str, Any] = {}
    saved_rng = rng_state()
    names = {m: n for n, m in pl_module.named_modules() if n}
    first_fwd: list[str] = []
    first_bwd: list[str] = []

    stack: list[str] = []

    def pre_hook(module: nn.Module, args: Any) -> None:
        stack.append(names.get(module, type(module).__name__))

    def fwd_hook(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()
        if not first_fwd and not _finite(output):
            first_fwd.append(names.get(module, type(module).__name__))

    def bwd_hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        if not first_bwd and _finite(grad_output) and not _finite(grad_input):
            first_bwd.append(names.get(module, type(module).__name__))

    ddp_no_sync = getattr(trainer.strategy.model, "no_sync", None)
    sync_ctx = ddp_no_sync() if callable(ddp_no_sync) else contextlib.nullcontext()
    handles = []
    try:
        with sync_ctx, _quiet_logging(pl_module), torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for module in names:
                handles.append(module.register_forward_pre_hook(pre_hook))
                handles.append(module.register_forward_hook(fwd_hook))
                if not any(True for _ in module.children()):
                    handles.append(module.register_full_backward_hook(bwd_hook))
            if rng is not None:
                set_rng_state(rng)
            pl_module.zero_grad(set_to_none=True)
            op_mode = _FirstBadOp(stack)
            try:
                with OpGuard(), op_mode:
                    _run(pl_module, batch, batch_idx)
            except Exception as err:  # the replay is a diagnosis: never fail the run over it
                result["error"] = f"{type(err).__name__}: {err}"
            if op_mode.found is not None:
                result["forward_op"], result["forward_op_module"] = op_mode.found
            for h in handles:
                h.remove()
            handles.clear()

            if rng is not None:
                set_rng_state(rng)
            pl_module.zero_grad(set_to_none=True)
            try:
                with OpGuard():  # the replayed batch must not trip the ops the guard protects
                    result.update(_first_bad_node(pl_module, batch, batch_idx))
            except Exception as err:
                result.setdefault("error", f"{type(err).__name__}: {err}")
    finally:
        for h in handles:
            h.remove()
        pl_module.zero_grad(set_to_none=True)
        set_rng_state(saved_rng)
    if first_bwd:
        result["module"] = first_bwd[0]
    if first_fwd:
        result["forward_module"] = first_fwd[0]
    log.debug("numguard replay of batch %s: %s", batch_idx, result)
    return result
