"""Find the op that made a step non-finite, given a closure that runs the step.

Runs only after an incident, never on clean steps. ``run_step`` is a closure that runs the
step's forward pass and returns what ``training_step`` returns (a loss tensor, a dict with a
``"loss"``, or ``None``); :func:`replay` calls it twice (once to trace the forward pass, once to
trace the backward pass) from the same RNG state. The caller restores the training state
afterwards: the replay's forward pass changes BatchNorm buffers and leaves gradients.

The culprit is the rule's (:func:`~lightning_numguard.diagnose.provenance.culprit_of`, where it is written).
:class:`~lightning_numguard.diagnose.provenance.Provenance` records every op at the dispatcher, in place and
``__setitem__`` included; the replay gives the rule the origins of the bad values it saw, and says what the
culprit is (:attr:`Replay.stage`):

- ``"forward"``: an op made it: ``op``, the module running it (``op_module``; ``None`` for the root
  module's own code) and the user's ``file``/``line``/``code`` *of that call*;
- ``"inputs"``: the value was already bad where the forward pass started: a parameter, a buffer or a
  batch field (``leaf``), or it came from another rank through a collective (``from_another_rank``:
  tensor parallelism's all-reduce): no op is named;
- ``"backward"``: the whole forward pass was finite: the culprit is the first autograd node whose
  gradients went non-finite from finite ones (``sqrt(0)``'s ``SqrtBackward0``).

"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.diagnose.calls import Calls, op_name, site
from lightning_numguard.diagnose.provenance import Origin, Provenance, culprit_of
from lightning_numguard.diagnose.usercode import is_library_file
from lightning_numguard.dtensor import local
from lightning_numguard.state.rng import NAMES, moved, rng_state, set_rng_state
from lightning_numguard.tree import tensor_leaves, tensors

__all__ = ["CULPRIT_FACTS", "Replay", "first_bad_node", "loss_of", "op_name", "replay"]

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
    "written",
)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.+)')


@dataclass(frozen=True)
class Replay:
    """What the replay of a step found (see :func:`replay`); empty (``stage=None``) when it found nothing or did not
    run. :meth:`details` is its record in an event's ``details["replay"]``."""

    #: ``"forward"``, ``"inputs"`` or ``"backward"`` (the module docstring); ``None``: nothing went non-finite
    stage: str | None = None
    #: the culprit op (``div``; an autograd node such as ``SqrtBackward0`` when the stage is ``"backward"``)
    op: str | None = None
    #: the innermost module running the culprit op (``None``: the root module's own code)
    op_module: str | None = None
    #: the first module, in backward order, whose input gradient went non-finite from a finite one
    module: str | None = None
    #: the first module whose output went non-finite (it received the value; it may not have made it)
    forward_module: str | None = None
    #: the user's line of the culprit call
    file: str | None = None
    line: int | None = None
    code: str | None = None
    forward_trace: str | None = None
    #: the forward culprit again, kept for older readers of the events
    forward_op: str | None = None
    forward_op_module: str | None = None
    #: ``stage="inputs"``: the parameter, buffer or batch field that held the value (``source``, ``name``)
    leaf: dict[str, str] | None = None
    #: ``stage="inputs"``: the value came from another rank through a collective (tensor parallelism)
    from_another_rank: bool = False
    first_bad_op: str | None = None
    #: what the culprit op's inputs looked like: their dtype, largest magnitude, whether one held ±Inf
    dtype: str | None = None
    max_abs_in: float | None = None
    inf_in: bool | None = None
    #: the culprit wrote a literal NaN/Inf (``x[i] = nan``)
    literal: bool | None = None
    #: more of what was measured at the culprit (:data:`CULPRIT_FACTS`): the smallest and largest finite values it
    #: read, what it made (NaN or Inf), a zero divisor, the values a ``std`` reduced and its correction, the CTC
    #: samples short of frames, the labels a loss counted
    min_in: float | None = None
    max_in: float | None = None
    made: str | None = None
    zero_divisor: bool | None = None
    reduced_over: int | None = None
    correction: float | None = None
    short_samples: int | None = None
    frames_needed: int | None = None
    frames: int | None = None
    labels_counted: int | None = None
    ignore_index: int | None = None
    #: the culprit wrote in place into a parameter, buffer or batch field (``source``, ``name``): ``fill_(nan)`` on a
    #: buffer in ``training_step``
    written: dict[str, str] | None = None
    #: the replay itself raised (it never propagates)
    error: str | None = None
    #: ``False``: the replay ran the step again (the same weights, inputs and RNG) and saw no non-finite value (it
    #: did not reproduce: :mod:`~lightning_numguard.diagnose.reproduce`); ``None`` otherwise (see :attr:`again`)
    reproduced: bool | None = None
    #: why the replay could not run the step again exactly, when it stayed finite: it drew from a generator whose
    #: state at the step's start was not kept (:class:`~lightning_numguard.state.rng.StepRng`); then it proves
    #: nothing either way (:attr:`again` is ``None``)
    unsure: str | None = None
    #: the generators (:data:`~lightning_numguard.state.rng.SOURCES`) the replay drew from without their state
    drew: tuple[str, ...] = field(default=(), compare=False)
    #: op name -> the user's line of each call, in call order (the op guard's findings take their line from it)
    op_sites: dict[str, list[dict[str, Any]]] = field(default_factory=dict, compare=False)
    #: the fields the passes found, in the order found (a found ``None``, the ``op_module`` of the root's own
    #: code, is a finding too); an event's ``details["replay"]`` holds these
    found: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def source(self) -> str | None:
        """``"file:line"`` of the culprit call, when known."""
        return f"{self.file}:{self.line}" if self.file else None

    @property
    def again(self) -> bool | None:
        """Whether the replay made a non-finite value again: ``None`` when it did not run, raised, or could not run the
        step again exactly and stayed finite (:attr:`unsure`)."""
        if self.error is not None or self.unsure is not None or not self.ran:
            return None
        return self.reproduced is not False

    @property
    def ran(self) -> bool:
        """Whether the replay ran and said anything (a stage, the first bad module, or an error)."""
        return bool(self.details())

    def details(self) -> dict[str, Any]:
        """The record of this replay in an event: the fields that were found, in the order found (``op_sites``
        left out)."""
        return {name: getattr(self, name) for name in self.found if name not in ("op_sites", "drew")}

    @classmethod
    def of(cls, found: dict[str, Any]) -> Replay:
        """The replay's record from what the passes found (keys of this class's fields)."""
        known = {k: v for k, v in found.items() if k in _REPLAY_FIELDS}
        return cls(**known, found=tuple(known))


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
    """The step's culprit (:func:`~lightning_numguard.diagnose.provenance.culprit_of`) among the bad values the
    forward pass made: the first bad module output and the loss."""
    found = [o for o in (seen.first_output[1] if seen.first_output else None, seen.loss) if o is not None]
    if not found and seen.provenance is not None and seen.provenance.first_nan is not None:
        # no module output and no loss went bad, but a NaN was there (a NaN weight whose attention kernel's output
        # stayed finite): the forward pass was not finite, and that NaN is what the backward pass spreads
        found = [seen.provenance.first_nan]
    return culprit_of(found)


def _made_nan(seen: _Seen) -> bool:
    """Whether the traced forward pass held a NaN at any point (even one a kernel swallowed)."""
    return seen.provenance is not None and seen.provenance.first_nan is not None


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
) -> Replay:
    """Run ``run_step`` (and its backward) from ``rng``; return what went non-finite first (a :class:`Replay`).

    The replay runs under
    :class:`~lightning_numguard.detect.opguard.OpGuard`, so it cannot trip a device-side assert either. The
    RNG state is put back afterwards. ``sites``: keep ``op_sites`` even when nothing went non-finite (the op
    guard's findings take their user line from it). ``batch``: the batch replayed, so that a value already
    bad in it is named by its path.

    ``agree``: for a step whose passes are collective (FSDP2's all-gathers, tensor parallelism's
    all-reduces), a collective "does any rank want it?" of this rank's wish for the second pass: every
    rank then runs it, or none, and a rank that did not want it ignores what it found.
    """
    result: dict[str, Any] = {}
    saved_rng = rng_state()
    # the generators whose state the step did not keep (the fit was not seen drawing from them): a replay that draws
    # from one of them is not exact
    unkept = {s: v for s, v in saved_rng.items() if s not in rng} if rng is not None else {}
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
            saw = seen.first_output is not None or not seen.loss_finite or _made_nan(seen)
            if not saw and "stage" not in result and "module" not in result and "error" not in result:
                drew = moved(unkept) if unkept else []
                if drew:
                    result["drew"] = tuple(drew)
                    names = " and ".join(NAMES[s] for s in drew)
                    result["unsure"] = f"the step draws from {names}, whose state at the step's start was not kept"
                else:
                    result["reproduced"] = False  # the step ran again and stayed finite
    finally:
        root.zero_grad(set_to_none=True)
        set_rng_state(saved_rng)
    if "stage" not in result and not sites:
        result.pop("op_sites", None)
    log.debug("numguard replay: %s", result)
    return Replay.of(result)


_REPLAY_FIELDS = frozenset(f.name for f in fields(Replay))
