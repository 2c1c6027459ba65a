"""Find the first op that made a step non-finite, given a closure that runs the step.

Runs only after an incident, never on clean steps. ``run_step`` is a closure that runs the
step's forward pass and returns what ``training_step`` returns (a loss tensor, a dict with a
``"loss"``, or ``None``); :func:`replay` calls it twice (once to trace the forward pass, once to
trace the backward pass) from the same RNG state. The caller restores the training state
afterwards: the replay's forward pass changes BatchNorm buffers and leaves gradients.

The rule (``result["stage"]``):

- ``"forward"``: the forward pass went non-finite: the culprit is the first forward op whose
  inputs were finite and whose output was not (``op``, the user's ``file``/``line``/``code``);
- ``"inputs"``: the first non-finite value of the forward pass came from an op's inputs (the
  batch or the weights were already bad), or from another rank through a collective
  (``from_another_rank``: tensor parallelism's all-reduce): no op is named;
- ``"backward"``: the whole forward pass was finite: the culprit is the first autograd node whose
  gradients went non-finite from finite ones (``sqrt(0)``'s ``SqrtBackward0``).

Infinities written on purpose (``masked_fill(mask, -inf)`` before a softmax) are not culprits;
the NaN the softmax makes of a fully masked row is.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import math
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_numguard._compat import caller_frame

from .dtensor import local
from .opguard import OpGuard
from .snapshot import rng_state, set_rng_state
from .tree import tensors
from .usercode import is_library_file, user_site

__all__ = ["first_bad_node", "loss_of", "op_name", "replay"]

log = logging.getLogger(__name__)

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.+)')
_ALIASES = {"truediv": "div", "rtruediv": "div", "rdiv": "div", "radd": "add", "rsub": "sub", "rmul": "mul"}
_ALIASES.update({"rpow": "pow", "rmatmul": "matmul", "iadd": "add_", "imul": "mul_", "itruediv": "div_"})
_IGNORED = {"__get__", "__set__", "__getitem__", "__setitem__", "__len__", "__format__", "__repr__"}
# Ops whose output is uninitialised memory (it may hold any bits, NaN included, until written): FSDP2 allocates
# its all-gather buffers with them, and the collective that fills a buffer is not a torch function call.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# Ops called by torch.distributed's own code (FSDP2's copies into and out of its all-gather buffers, which hold
# uninitialised memory until a collective the trace does not see has filled them) are not watched; its
# collectives are, as the way another rank's values arrive.
_DISTRIBUTED = "/torch/distributed/"


def _local_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj``, a ``DTensor`` as this rank's local shard: a test on a ``DTensor`` read on the host
    would be a collective, run by this rank alone when it found something (and hang)."""
    return [local(t) for t in tensors(obj)]


def _finite(obj: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _local_tensors(obj) if t.is_floating_point())


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, or a dict's ``"loss"``), else ``None``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


def op_name(func: Any) -> str:
    """The plain name of a torch function or tensor method: ``Tensor.__truediv__`` -> ``div``."""
    name = str(getattr(func, "__name__", func))
    bare = name.strip("_")
    return _ALIASES.get(bare, bare) if name.startswith("__") else name


def _has(obj: Any, test: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    return any(bool(test(t).any()) for t in _local_tensors(obj) if t.is_floating_point())


def _scalars_finite(args: Any, kwargs: dict[str, Any]) -> bool:
    values = list(args) + list(kwargs.values())
    return all(math.isfinite(v) for v in values if isinstance(v, float))


def _site(file: str, line: int) -> dict[str, Any]:
    return {"file": file, "line": line, "code": linecache.getline(file, line).strip()}


def _overflow_facts(inputs: Any, out: Any) -> dict[str, Any]:
    """The culprit op's output dtype and its inputs' largest finite ``|x|`` (an overflow from finite values)."""
    floats = [t for t in _local_tensors(out) if t.is_floating_point()]
    facts: dict[str, Any] = {"dtype": str(floats[0].dtype).replace("torch.", "")} if floats else {}
    with torch.no_grad():
        peaks = [
            float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())
            for t in _local_tensors(inputs)
            if t.is_floating_point() and t.numel()
        ]
    peaks += [abs(v) for v in inputs[0] if isinstance(v, float) and math.isfinite(v)]
    if peaks:
        facts["max_abs_in"] = max(peaks)
    if _has(inputs, torch.isinf):  # NaN from ±Inf (a fully masked softmax row): the inputs were not finite
        facts["inf_in"] = True
    return facts


class _ForwardTrace(TorchFunctionMode):
    """Watches every torch call of the forward pass for the first non-finite value and where it came from."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.culprit: dict[str, Any] | None = None  # finite inputs, non-finite output
        self.inputs_bad: dict[str, Any] | None = None  # the first non-finite output came from bad inputs
        self.constant: dict[str, Any] | None = None  # a non-finite constant argument (`loss * inf`)
        self.sites: dict[str, dict[str, Any]] = {}  # the first user site of every op called

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self.culprit is not None or name in _IGNORED or name in _UNINITIALISED:
            return out
        if _DISTRIBUTED in _caller_file(caller_frame(1)) and not _collective(func):
            return out  # torch.distributed's own bookkeeping (FSDP2 copies into and out of its all-gather buffers)
        op = op_name(func)
        if op not in self.sites:
            where = user_site(caller_frame(1))
            self.sites[op] = _site(*where) if where else {}
        nan_out, inf_out = _has(out, torch.isnan), _has(out, torch.isinf)
        if not (nan_out or inf_out):
            return out
        inputs = [args, list(kwargs.values())]
        scalars_ok = _scalars_finite(args, kwargs)
        nan_in = _has(inputs, torch.isnan) or any(
            isinstance(v, float) and math.isnan(v) for v in list(args) + list(kwargs.values())
        )
        entry = {"op": op, "module": self.stack[-1] if self.stack else None, **self.sites[op]}
        made_here = (nan_out and not nan_in) or (inf_out and scalars_ok and _finite(inputs))
        if _collective(func):  # another rank's values arrived (tensor parallelism's all-reduce); the all-reduce's
            # output may be checked before they did (an asynchronous collective tensor), and first seen non-finite
            # as the input of the op that waits for it (``_c10d_functional._wrap_tensor_autograd``)
            if self.inputs_bad is None and self.constant is None:
                self.inputs_bad = {**entry, "from_another_rank": True}
        elif made_here:
            self.culprit = {**entry, **_overflow_facts(inputs, out)}
        elif not _finite(inputs) and self.inputs_bad is None and self.constant is None:
            self.inputs_bad = entry
        elif not scalars_ok and self.constant is None:
            self.constant = entry
        return out


def _caller_file(frame: Any) -> str:
    """The file of the code that called a torch function, past the ``torch.ops`` call machinery, with ``/``."""
    while frame is not None and frame.f_code.co_filename.replace("\\", "/").endswith("/torch/_ops.py"):
        frame = frame.f_back
    return frame.f_code.co_filename.replace("\\", "/") if frame is not None else ""


def _collective(func: Any) -> bool:
    """Whether ``func`` is a ``torch.distributed`` collective: its output holds other ranks' values, so a NaN it
    returns from this rank's finite inputs was made elsewhere (that rank's replay names it)."""
    module = str(getattr(func, "__module__", "") or "")  # torch.ops._c10d_functional.*, torch.distributed.*
    return module.startswith("torch.distributed") or "c10d" in module


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

    Returns ``op`` (e.g. ``SqrtBackward0``), ``forward_trace`` (``file:line in func: code``) and
    ``file``/``line``/``code`` of the user's line that created it, when found. Anomaly mode's
    ``check_nan`` only sees NaN (``sqrt(0)``'s backward returns Inf first), so the graph is walked
    instead; anomaly mode still records each node's forward traceback.
    """
    found: dict[str, Any] = {}

    def hook(grad_inputs: Any, grad_outputs: Any, node: Any) -> None:
        if found or not _finite(grad_outputs) or _finite(grad_inputs):
            return
        found["op"] = type(node).__name__
        trace = (node.metadata or {}).get("traceback_") if hasattr(node, "metadata") else None
        if trace:
            frames = _FRAME.findall("".join(trace))
            user = [f for f in frames if not is_library_file(f[0])]
            if user:
                file, line, func, code = user[-1]
                found["forward_trace"] = f"{file}:{line} in {func}: {code.strip()}"
                found.update({"file": file, "line": int(line), "code": code.strip()})

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


def _forward(root: nn.Module, run_step: Callable[[], Any], result: dict[str, Any]) -> _ForwardTrace:
    """The forward (and backward) pass under the trace; fills ``forward_module``, ``module``, ``error``."""
    first_fwd: list[str] = []
    first_bwd: list[str] = []
    stack: list[str] = []
    trace = _ForwardTrace(stack)
    with _module_hooks(root, first_fwd, first_bwd, stack):
        try:
            with OpGuard(), trace:
                loss = loss_of(run_step())
            result["loss_finite"] = loss is None or _finite(loss)
            if loss is not None and loss.requires_grad:
                loss.backward()
        except Exception as err:  # the replay is a diagnosis: never fail the run over it
            result["error"] = f"{type(err).__name__}: {err}"
    if first_fwd:
        result["forward_module"] = first_fwd[0]
    if first_bwd:
        result["module"] = first_bwd[0]
    result["op_sites"] = trace.sites
    return trace


def replay(
    root: nn.Module,
    run_step: Callable[[], Any],
    rng: dict[str, Any] | None = None,
    sites: bool = False,
    agree: Callable[[bool], bool] | None = None,
) -> dict[str, Any]:
    """Run ``run_step`` (and its backward) from ``rng``; return what went non-finite first.

    Returns a dict with ``stage`` (see the module docstring) when anything went non-finite, and:
    ``op``, ``file``, ``line``, ``code`` (the culprit op and the user's line; ``op`` is a forward op
    such as ``div`` when the stage is ``"forward"`` and an autograd node such as ``SqrtBackward0``
    when it is ``"backward"``), ``op_module`` (the innermost module running it), ``forward_module``
    (the first module whose output went non-finite), ``module`` (the first module, in backward
    order, whose input gradient went non-finite from a finite one), ``forward_op`` /
    ``forward_op_module`` (the forward culprit, kept for older readers), ``forward_trace``,
    ``op_sites`` (op name -> the user's first line calling it) and ``error`` if the replay itself
    raised (it never propagates). The replay runs under
    :class:`~lightning_numguard.core.opguard.OpGuard`, so it cannot trip a device-side assert
    either. The RNG state is put back afterwards. ``sites``: keep ``op_sites`` even when nothing
    went non-finite (the op guard's findings take their user line from it).

    ``agree``: for a step whose passes are collective (FSDP2's all-gathers, tensor parallelism's
    all-reduces), a collective "does any rank want it?" of this rank's wish for the second pass: every
    rank then runs it, or none, and a rank that did not want it ignores what it found.
    """
    result: dict[str, Any] = {}
    saved_rng = rng_state()
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if rng is not None:
                set_rng_state(rng)
            root.zero_grad(set_to_none=True)
            trace = _forward(root, run_step, result)
            chosen = trace.culprit or (None if trace.inputs_bad else trace.constant)
            if chosen is not None:
                result.update(stage="forward", op=chosen["op"], op_module=chosen["module"])
                facts = ("file", "line", "code", "dtype", "max_abs_in", "inf_in")
                result.update({k: chosen[k] for k in facts if k in chosen})
                result["forward_op"], result["forward_op_module"] = chosen["op"], chosen["module"]
                if "file" in chosen:
                    result["forward_trace"] = f"{chosen['file']}:{chosen['line']}: {chosen.get('code', '')}"
            elif trace.inputs_bad is not None:
                result.update(stage="inputs", first_bad_op=trace.inputs_bad["op"])
                if trace.inputs_bad.get("from_another_rank"):
                    result["from_another_rank"] = True
            wish = chosen is None and trace.inputs_bad is None
            wish = wish and result.get("loss_finite", True) and "error" not in result
            if agree(wish) if agree is not None else wish:
                if rng is not None:
                    set_rng_state(rng)
                root.zero_grad(set_to_none=True)
                try:
                    with OpGuard():
                        node = first_bad_node(run_step)
                except Exception as err:
                    result.setdefault("error", f"{type(err).__name__}: {err}")
                    node = {}
                if wish and node.get("op"):
                    result.update(stage="backward", op_module=result.get("module"), **node)
    finally:
        root.zero_grad(set_to_none=True)
        set_rng_state(saved_rng)
    result.pop("loss_finite", None)
    if "stage" not in result and not sites:
        result.pop("op_sites", None)
    log.debug("numguard replay: %s", result)
    return result
