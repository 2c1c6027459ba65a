"""Find the first module, forward op and autograd node that went non-finite, given a closure.

Runs only after an incident, never on clean steps. ``run_step`` is a closure that runs the
step's forward pass and returns what ``training_step`` returns (a loss tensor, a dict with a
``"loss"``, or ``None``); :func:`replay` calls it twice (once to trace the forward pass, once to
trace the backward pass) from the same RNG state. The caller restores the training state
afterwards: the replay's forward pass changes BatchNorm buffers and leaves gradients.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .opguard import OpGuard
from .snapshot import rng_state, set_rng_state
from .tree import tensors

__all__ = ["first_bad_node", "loss_of", "replay"]

log = logging.getLogger(__name__)

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)')


def _finite(obj: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors(obj) if t.is_floating_point())


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, or a dict's ``"loss"``), else ``None``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


class _FirstBadOp(TorchFunctionMode):
    """Records the first op whose floating inputs were all finite but whose output was not."""

    def __init__(self, current: list[str]) -> None:
        super().__init__()
        self.current = current
        self.found: tuple[str, str | None] | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            self.found is None
            and isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and not _finite(out)
            and _finite([args, list((kwargs or {}).values())])
        ):
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


def first_bad_node(run_step: Callable[[], Any]) -> dict[str, Any]:
    """Backward with a hook on every autograd node: the first whose gradients went NaN/Inf from finite ones.

    Returns ``op`` (e.g. ``SqrtBackward0``) and ``forward_trace`` (the user line that created it),
    when found. Anomaly mode's ``check_nan`` only sees NaN (``sqrt(0)``'s backward returns Inf
    first), so the graph is walked instead; anomaly mode still records each node's forward traceback.
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
        loss = loss_of(run_step())
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


@contextlib.contextmanager
def _module_hooks(root: nn.Module, first_fwd: list[str], first_bwd: list[str], stack: list[str]) -> Iterator[None]:
    names = {m: n for n, m in root.named_modules() if n}

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

    handles = []
    try:
        for module in names:
            handles.append(module.register_forward_pre_hook(pre_hook))
            handles.append(module.register_forward_hook(fwd_hook))
            if not any(True for _ in module.children()):
                handles.append(module.register_full_backward_hook(bwd_hook))
        yield
    finally:
        for h in handles:
            h.remove()


def replay(root: nn.Module, run_step: Callable[[], Any], rng: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``run_step`` (and its backward) twice from ``rng``; return what went non-finite first.

    Returns a dict with, when found: ``module`` (first module, in backward order, whose
    gradient w.r.t. its inputs went non-finite while the gradient it received was finite),
    ``forward_module`` (first module whose output went non-finite), ``forward_op`` and
    ``forward_op_module`` (the first op whose finite inputs gave a non-finite output, e.g.
    ``div``, and the innermost module running it), ``op`` and ``forward_trace`` (from
    :func:`first_bad_node`), and ``error`` if the replay itself raised (it never propagates).
    The replay runs under :class:`~lightning_numguard.core.opguard.OpGuard`, so it cannot trip a
    device-side assert either. The RNG state is put back afterwards.
    """
    result: dict[str, Any] = {}
    saved_rng = rng_state()
    first_fwd: list[str] = []
    first_bwd: list[str] = []
    stack: list[str] = []

    def step_and_backward() -> None:
        loss = loss_of(run_step())
        if loss is not None and loss.requires_grad:
            loss.backward()

    try:
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _module_hooks(root, first_fwd, first_bwd, stack):
                if rng is not None:
                    set_rng_state(rng)
                root.zero_grad(set_to_none=True)
                op_mode = _FirstBadOp(stack)
                try:
                    with OpGuard(), op_mode:
                        step_and_backward()
                except Exception as err:  # the replay is a diagnosis: never fail the run over it
                    result["error"] = f"{type(err).__name__}: {err}"
                if op_mode.found is not None:
                    result["forward_op"], result["forward_op_module"] = op_mode.found
            if rng is not None:
                set_rng_state(rng)
            root.zero_grad(set_to_none=True)
            try:
                with OpGuard():
                    result.update(first_bad_node(run_step))
            except Exception as err:
                result.setdefault("error", f"{type(err).__name__}: {err}")
    finally:
        root.zero_grad(set_to_none=True)
        set_rng_state(saved_rng)
    if first_bwd:
        result["module"] = first_bwd[0]
    if first_fwd:
        result["forward_module"] = first_fwd[0]
    log.debug("numguard replay: %s", result)
    return result
