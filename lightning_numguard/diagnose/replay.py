"""Find the op that made a step non-finite, given a closure that runs the step.

Runs only after an incident, never on clean steps. ``run_step`` is a closure that runs the
step's forward pass and returns what ``training_step`` returns (a loss tensor, a dict with a
``"loss"``, or ``None``); :func:`replay` calls it twice (once to trace the forward pass, once to
trace the backward pass) from the same RNG state. The caller restores the training state
afterwards: the replay's forward pass changes BatchNorm buffers and leaves gradients.

The rule, by definition: **the culprit is the first op, in execution order, that wrote a NaN or Inf
that none of its inputs held, and whose value reaches the bad value the step detected** (the first
module output that went non-finite, or the loss). :class:`~lightning_numguard.diagnose.provenance.Provenance`
records every op at the dispatcher, in place and ``__setitem__`` included, and walks back from the bad
value to the op that made it (``result["stage"]``):

- ``"forward"``: an op made it: ``op``, the module running it (``op_module``; ``None`` for the root
  module's own code) and the user's ``file``/``line``/``code`` *of that call*;
- ``"inputs"``: the value was already bad where the forward pass started: a parameter, a buffer or a
  batch field (``leaf``), or it came from another rank through a collective (``from_another_rank``:
  tensor parallelism's all-reduce): no op is named;
- ``"backward"``: the whole forward pass was finite: the culprit is the first autograd node whose
  gradients went non-finite from finite ones (``sqrt(0)``'s ``SqrtBackward0``).

Non-finite values that never reach the bad value are never culprits (T5's ``log(0)`` in its position
buckets, a causal mask's ``-inf``); a NaN made from an Inf written on purpose is (a softmax over a fully
masked row: ``inf_in``).
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

from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.diagnose.calls import Calls, op_name, site
from lightning_numguard.diagnose.provenance import Origin, Provenance
from lightning_numguard.diagnose.usercode import is_library_file
from lightning_numguard.dtensor import local
from lightning_numguard.state.snapshot import rng_state, set_rng_state
from lightning_numguard.tree import tensor_leaves, tensors

__all__ = ["CULPRIT_FACTS", "first_bad_node", "loss_of", "op_name", "replay"]

log = logging.getLogger(__name__)

#: What the replay measured at the culprit op that the events carry (the hints read them: ``reporting/hints``).
CULPRIT_FACTS = (
    "dtype",
    "max_abs_in",
    "min_in",
    "max_in",
    "inf_in",
    "literal",
    "made",
    "zero_divisor",
    "reduced_over",
    "correction",
    "short_samples",
    "frames_needed",
    "frames",
    "labels_counted",
    "ignore_index",
)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.+)')


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
def _module_hooks(root: nn.Module, seen: _Seen, stack: list[str]) -> Iterator[None]:
    """Forward hooks only: the module stack at each call, and the first module whose output went non-finite.

    No backward hook here: a full backward hook wraps module outputs in a custom autograd Function, and a user's
    forward hook that writes into such an output in place (``out[i] = v``) would raise in the replay only.
    """
    names = {m: n for n, m in root.named_modules() if n}

    def pre_hook(module: nn.Module, args: Any) -> None:
        stack.append(names.get(module, type(module).__name__))

    def fwd_hook(module: nn.Module, args: Any, output: Any) -> None:
        if seen.first_output is None and seen.provenance is not None and not _finite(output):
            origin = seen.provenance.origin_of(output)
            seen.first_output = (names.get(module, type(module).__name__), origin)
        if stack:
            stack.pop()

    handles = []
    try:
        for module in names:
            handles.append(module.register_forward_pre_hook(pre_hook))
            # always_call: the stack is popped even when a later hook raises
            handles.append(module.register_forward_hook(fwd_hook, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _backward_hooks(root: nn.Module, seen: _Seen) -> Iterator[None]:
    """The first leaf module, in backward order, whose input gradient went non-finite from a finite one."""
    names = {m: n for n, m in root.named_modules() if n}

    def bwd_hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        if seen.first_backward is None and _finite(grad_output) and not _finite(grad_input):
            seen.first_backward = names.get(module, type(module).__name__)

    handles = [m.register_full_backward_hook(bwd_hook) for m in names if not any(True for _ in m.children())]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _Seen:
    """What the instrumented forward and backward passes saw."""

    def __init__(self) -> None:
        self.provenance: Provenance | None = None
        self.first_output: tuple[str, Origin | None] | None = None  # the first module whose output went bad
        self.first_backward: str | None = None
        self.loss: Origin | None = None
        self.loss_finite = True


def _leaf_map(root: nn.Module, batch: Any) -> Callable[[], dict[int, tuple[str, str]]]:
    """``() -> {storage: (source, name)}`` of ``root``'s parameters and buffers and the batch's tensors."""

    def build() -> dict[int, tuple[str, str]]:
        found: dict[int, tuple[str, str]] = {}
        for path, t in tensor_leaves(batch) if batch is not None else []:
            _add(found, t, ("input", path))
        for name, t in root.named_buffers():
            _add(found, t, ("buffer", name))
        for name, t in root.named_parameters():
            _add(found, t, ("param", name))
        return found

    return build


def _add(found: dict[int, tuple[str, str]], t: Any, value: tuple[str, str]) -> None:
    if isinstance(t, torch.Tensor):
        with contextlib.suppress(Exception):  # no storage (a tensor subclass): not a leaf the trace can match
            found[int(local(t).untyped_storage().data_ptr())] = value


def _forward(root: nn.Module, run_step: Callable[[], Any], result: dict[str, Any], batch: Any) -> _Seen:
    """The forward pass under the trace; fills ``forward_module``, ``error``, ``op_sites``."""
    seen = _Seen()
    stack: list[str] = []
    calls = Calls()
    provenance = Provenance(stack, _leaf_map(root, batch), current_call=lambda: calls.current)
    seen.provenance = provenance
    with _module_hooks(root, seen, stack):
        try:
            with OpGuard(), calls, provenance:
                loss = loss_of(run_step())
                seen.loss_finite = loss is None or _finite(loss)
                if not seen.loss_finite:
                    seen.loss = provenance.origin_of(loss)
        except Exception as err:  # the replay is a diagnosis: never fail the run over it
            result["error"] = f"{type(err).__name__}: {err}"
    if seen.first_output is not None:
        result["forward_module"] = seen.first_output[0]
    result["op_sites"] = calls.sites
    return seen


def _chosen(seen: _Seen) -> Origin | None:
    """The rule's culprit: of the bad values the forward pass made (the first bad module output, the loss),
    the earliest origin in execution order, walked back past NaN made of an accidental Inf."""
    found = [o for o in (seen.first_output[1] if seen.first_output else None, seen.loss) if o is not None]
    if not found and seen.provenance is not None and seen.provenance.first_nan is not None:
        # no module output and no loss went bad, but a NaN was there (a NaN weight whose attention kernel's output
        # stayed finite): the forward pass was not finite, and that NaN is what the backward pass spreads
        found = [seen.provenance.first_nan]
    culprits = [Provenance.culprit(o) for o in found]
    return min(culprits, key=lambda o: o.seq) if culprits else None


def _describe(origin: Origin, result: dict[str, Any]) -> None:
    """The result's fields for a forward culprit (``stage="forward"``) or a leaf (``stage="inputs"``)."""
    if origin.source == "op":
        result.update(stage="forward", op=origin.op, op_module=origin.module)
        if origin.site is not None:
            result.update(site(*origin.site))
            result["forward_trace"] = f"{result['file']}:{result['line']}: {result.get('code', '')}"
        result.update({k: v for k, v in origin.facts.items() if k in CULPRIT_FACTS})
        result["forward_op"], result["forward_op_module"] = origin.op, origin.module
    elif origin.source == "rank":
        result.update(stage="inputs", from_another_rank=True)
        if origin.op:
            result["first_bad_op"] = origin.op
    else:
        result.update(stage="inputs")
        if origin.name is not None:
            result["leaf"] = {"source": origin.source, "name": origin.name}


def _backward(
    root: nn.Module, run_step: Callable[[], Any], rng: dict[str, Any] | None, result: dict[str, Any], retry: bool
) -> dict[str, Any]:
    """The backward pass's first bad autograd node, and (``result["module"]``) the first leaf module whose input
    gradient went bad. A step that cannot run under module backward hooks runs again without them (``retry``: a
    single process; under a collective step every rank must run the same passes)."""
    seen = _Seen()
    try:
        with OpGuard(), _backward_hooks(root, seen):
            node = first_bad_node(run_step)
    except Exception as err:
        if not retry:
            result.setdefault("error", f"{type(err).__name__}: {err}")
            return {}
        if rng is not None:
            set_rng_state(rng)
        root.zero_grad(set_to_none=True)
        try:
            with OpGuard():
                node = first_bad_node(run_step)
        except Exception as again:
            result.setdefault("error", f"{type(again).__name__}: {again}")
            return {}
    if seen.first_backward is not None:
        result["module"] = seen.first_backward
    return node


def replay(
    root: nn.Module,
    run_step: Callable[[], Any],
    rng: dict[str, Any] | None = None,
    sites: bool = False,
    agree: Callable[[bool], bool] | None = None,
    batch: Any = None,
) -> dict[str, Any]:
    """Run ``run_step`` (and its backward) from ``rng``; return what went non-finite first.

    Returns a dict with ``stage`` (see the module docstring) when anything went non-finite, and:
    ``op``, ``file``, ``line``, ``code`` (the culprit op and the user's line of that call; ``op`` is a
    forward op such as ``div`` when the stage is ``"forward"`` and an autograd node such as
    ``SqrtBackward0`` when it is ``"backward"``), ``op_module`` (the innermost module running it; ``None``:
    the root module's own code), ``forward_module`` (the first module whose output went non-finite: it
    received the value, it may not have made it), ``module`` (the first module, in backward order, whose
    input gradient went non-finite from a finite one), ``leaf`` (``stage="inputs"``: the parameter, buffer or
    batch field that held the value), what was measured at a forward culprit (:data:`CULPRIT_FACTS`: its dtype,
    the smallest, largest and largest-magnitude finite values it read, whether an input held ±Inf, and for a few ops
    a zero divisor, the values a ``std`` reduced, the CTC samples short of frames, the labels a loss counted),
    ``forward_op`` / ``forward_op_module`` (the forward culprit, kept for older readers), ``forward_trace``,
    ``op_sites`` (op name -> the user's line of each call, in call order) and ``error`` if the replay itself
    raised (it never propagates). The replay runs under :class:`~lightning_numguard.detect.opguard.OpGuard`, so
    it cannot trip a device-side assert either. The
    RNG state is put back afterwards. ``sites``: keep ``op_sites`` even when nothing went non-finite (the op
    guard's findings take their user line from it). ``batch``: the batch replayed, so that a value already
    bad in it is named by its path.

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
            seen = _forward(root, run_step, result, batch)
            chosen = _chosen(seen)
            if chosen is not None:
                _describe(chosen, result)
            wish = chosen is None and seen.loss_finite and "error" not in result
            if agree(wish) if agree is not None else wish:
                if rng is not None:
                    set_rng_state(rng)
                root.zero_grad(set_to_none=True)
                node = _backward(root, run_step, rng, result, retry=agree is None)
                if wish and node.get("op"):
                    result.update(stage="backward", op_module=result.get("module"), **node)
    finally:
        root.zero_grad(set_to_none=True)
        set_rng_state(saved_rng)
    if "stage" not in result and not sites:
        result.pop("op_sites", None)
    log.debug("numguard replay: %s", result)
    return result
