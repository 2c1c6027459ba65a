"""Where a non-finite value came from: every op of a replayed forward pass, recorded at the dispatcher.

Runs only during the replay after a hit. :class:`Provenance` sees every aten op (out-of-place, in place,
``__setitem__``'s ``fill_``/``index_put_``, ``copy_``, ``masked_fill_``), and for each tensor an op writes
that holds NaN or ±Inf it records the *origin* of that kind of value:

- a tensor read by the op already held the same kind: the value was carried, and its origin is the earliest
  origin among those inputs (in execution order; a leaf comes before every op);
- none did: this op *made* it, and is the origin (with its module, its call's user line, and, for a NaN made
  from ±Inf inputs, where that Inf came from).

A tensor holding NaN/Inf that no traced op wrote is a leaf: a parameter, a buffer or a batch field by its
storage, else a constant (``torch.tensor(nan)``): a constant is never an origin; the op that writes it into
a tensor is (``x[i] = nan``: the write, at its line). An Inf made from a constant (``masked_fill(mask,
-inf)``, ``torch.full(..., -inf)``) is *deliberate*, a mask.

The culprit rule is :func:`culprit_of`'s, stated there once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_numguard._compat import TorchDispatchMode, caller_frame, first_frame
from lightning_numguard.diagnose.usercode import user_site
from lightning_numguard.dtensor import local

__all__ = ["Origin", "Provenance", "culprit_of", "op_base_name"]

NAN, INF = "nan", "inf"
# Ops whose output is uninitialised memory (may hold any bits until written): never an origin.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_"}
# The namespaces of torch.distributed's collectives: a NaN they write came from another rank.
_COLLECTIVES = ("_c10d_functional", "c10d", "c10d_functional", "_dtensor")
_DISTRIBUTED = "/torch/distributed/"


@dataclass
class Origin:
    """Where one kind of non-finite value (NaN, or ±Inf) first appeared.

    ``source`` is ``"op"`` (an op made it), ``"param"``, ``"buffer"``, ``"input"`` (a leaf that held it before
    the forward pass; ``name`` says which), ``"rank"`` (it arrived through a collective from another rank) or
    ``"constant"`` (a literal: never a culprit by itself).
    """

    source: str
    seq: int = -1
    op: str | None = None
    module: str | None = None
    site: tuple[str, int] | None = None
    name: str | None = None
    #: an Inf written from a constant: a mask, not a fault
    deliberate: bool = False
    #: for a NaN made from ±Inf inputs: where that Inf came from
    from_inf: Origin | None = None
    facts: dict[str, Any] = field(default_factory=dict)


def op_base_name(func: Any) -> str:
    """``aten.fill_.Tensor`` -> ``fill_`` (the op's name without namespace and overload)."""
    name = func.name() if callable(getattr(func, "name", None)) else str(func)
    return str(name).split("::")[-1].split(".")[0]


def _key(t: torch.Tensor) -> int | None:
    """The storage a tensor's values live in (views share it), or ``None`` for a tensor without one."""
    try:
        return int(local(t).untyped_storage().data_ptr())
    except Exception:  # a tensor subclass without storage: not tracked
        return None


def _kinds(t: torch.Tensor) -> tuple[bool, bool]:
    """``(holds NaN, holds ±Inf)`` of ``t``'s local values (after a hit only: it reads them)."""
    values = local(t)
    if not values.is_floating_point() and not values.is_complex():
        return False, False
    if values.numel() == 0 or bool(torch.isfinite(values).all()):
        return False, False
    return bool(torch.isnan(values).any()), bool(torch.isinf(values).any())


def _flat(obj: Any) -> Iterable[Any]:
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _flat(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _flat(item)
    else:
        yield obj


class Provenance(TorchDispatchMode):
    """The dispatcher-level record of where each NaN and Inf of a forward pass came from.

    Args:
        stack: the module stack at each call (innermost last), kept by the caller's module hooks.
        leaves: ``() -> {storage: (source, name)}`` for the parameters, buffers and batch fields, asked
            again when a storage is not found (FSDP2 registers its unsharded parameters during the forward).
        current_call: ``() -> the torch-level name of the call running now`` (``linear`` for ``addmm``), or
            ``None``: ops are then named by their aten name.
    """

    def __init__(
        self,
        stack: list[str],
        leaves: Callable[[], dict[int, tuple[str, str]]],
        current_call: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__()
        self.stack = stack
        self._leaves_of = leaves
        self._leaves: dict[int, tuple[str, str]] | None = None
        self._current_call = current_call
        self._seq = 0
        self._before: dict[int, tuple[bool, bool]] = {}  # the in-place op running now: what its target held before
        self.tags: dict[str, dict[int, Origin]] = {NAN: {}, INF: {}}
        #: the earliest origin of any NaN the forward pass held, even one a kernel swallowed before a module's output
        self.first_nan: Origin | None = None
        # several processes: a NaN no traced op wrote arrived through torch.distributed's own code (an all-reduce
        # inside a DTensor redistribution); alone, it is a literal made outside the trace
        dist = torch.distributed
        self._elsewhere = "rank" if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else ""

    # ------------------------------------------------------------------------------------------- queries

    def origin(self, t: torch.Tensor, kind: str) -> Origin:
        """The origin of the ``kind`` values (``"nan"``/``"inf"``) ``t`` holds now."""
        key = _key(t)
        tagged = self.tags[kind].get(key) if key is not None else None
        if tagged is not None:
            return tagged
        leaf = self._leaf(key)
        if leaf.source == "constant" and kind == NAN and self._elsewhere:
            return Origin(self._elsewhere, self._seq)  # it arrived when this op read it
        return leaf

    def origin_of(self, obj: Any) -> Origin | None:
        """The earliest origin of the non-finite values in ``obj`` (a tensor or a nest of them), or ``None``."""
        found: list[Origin] = []
        for t in _flat(obj):
            if isinstance(t, torch.Tensor):
                nan, inf = _kinds(t)
                found += [self.origin(t, NAN)] if nan else []
                found += [self.origin(t, INF)] if inf and not nan else []
        real = [o for o in found if o.source != "constant"]
        return min(real or found, key=lambda o: o.seq) if found else None

    @staticmethod
    def culprit(origin: Origin) -> Origin:
        """The culprit of one bad value of this ``origin`` (:func:`culprit_of`'s walk past an accidental Inf)."""
        seen = 0
        while origin.source == "op" and origin.from_inf is not None and not origin.from_inf.deliberate and seen < 64:
            if origin.from_inf.source == "constant":
                break
            origin, seen = origin.from_inf, seen + 1
        return origin

    # -------------------------------------------------------------------------------------------- record

    def _leaf(self, key: int | None) -> Origin:
        if key is not None:
            if self._leaves is None or key not in self._leaves:
                self._leaves = self._leaves_of()
            hit = self._leaves.get(key)
            if hit is not None:
                return Origin(hit[0], name=hit[1])
        return Origin("constant")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = op_base_name(func)
        # an op writing in place reads the tensor it writes: what that held before the write is what it read
        self._before = {id(a): _kinds(a) for a in _flat(args[:1]) if isinstance(a, torch.Tensor)} if (
            name.endswith("_") and not getattr(func, "is_view", False)
        ) else {}  # fmt: skip
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return out  # a view writes nothing: it shares its input's storage, and with it the origin
        if name in _UNINITIALISED or name.startswith(("is", "_local_scalar")):
            return out
        self._seq += 1
        written = [t for t in _flat(out) if isinstance(t, torch.Tensor)]
        mutated = [a for a in _flat(args[:1]) if isinstance(a, torch.Tensor)] if name.endswith("_") else []
        mutated += [t for t in _flat(kwargs.get("out")) if isinstance(t, torch.Tensor)]
        fresh = [t for t in written if all(t is not m for m in mutated)]
        for t in fresh:  # a new storage: what it holds is what this op wrote
            self._record(func, name, t, args, kwargs, clear=True)
        for t in mutated:
            self._record(func, name, t, args, kwargs, clear=False)
        return out

    def _record(self, func: Any, name: str, t: torch.Tensor, args: Any, kwargs: Any, clear: bool) -> None:
        key = _key(t)
        if key is None:
            return
        nan, inf = _kinds(t)
        for kind, holds in ((NAN, nan), (INF, inf)):
            if not holds:
                if clear:
                    self.tags[kind].pop(key, None)
                continue
            origin = self._origin_of_write(func, name, kind, args, kwargs, t)
            if origin is not None:
                if origin.seq == self._seq and origin.source == "op":
                    origin.facts.setdefault("dtype", str(t.dtype).replace("torch.", ""))
                    leaf = self._leaf(key) if not clear else None  # written in place into a parameter, buffer...
                    if leaf is not None and leaf.source != "constant":
                        origin.facts.setdefault("written", {"source": leaf.source, "name": leaf.name})
                self.tags[kind][key] = origin
                if (
                    kind == NAN
                    and origin.source != "constant"
                    and (self.first_nan is None or origin.seq < self.first_nan.seq)
                ):
                    self.first_nan = origin

    def _origin_of_write(
        self, func: Any, name: str, kind: str, args: Any, kwargs: Any, out: torch.Tensor
    ) -> Origin | None:
        if _from_distributed():
            return None  # torch.distributed's own copies and collectives (FSDP2's all-gathers): not the model's
        if str(getattr(func, "namespace", "")) in _COLLECTIVES:
            return Origin("rank", self._seq, op=name, module=self._module())
        if name.startswith("lift"):  # torch.tensor(nan): the literal, made where the user wrote it
            site = user_site(caller_frame(1))
            return Origin(
                "op",
                self._seq,
                op=self._call_name(name),
                module=self._module(),
                site=site,
                deliberate=kind == INF,
                facts={"literal": True},
            )
        inputs = [a for a in _flat((args, kwargs)) if isinstance(a, torch.Tensor)]
        scalars = [a for a in _flat((args, kwargs)) if isinstance(a, float)]
        carried: list[Origin] = []
        constant = any((math.isnan(v) if kind == NAN else math.isinf(v)) for v in scalars)
        inf_from: list[Origin] = []
        for t in inputs:
            nan, inf = self._before.get(id(t)) or _kinds(t)
            if (nan if kind == NAN else inf) and t.numel():
                origin = self.origin(t, kind)
                if origin.source == "constant":
                    constant = True
                else:
                    carried.append(origin)
            if kind == NAN and inf:
                inf_from.append(self.origin(t, INF))
        if carried:
            return min(carried, key=lambda o: o.seq)
        site = user_site(caller_frame(1))
        origin = Origin("op", self._seq, op=self._call_name(name), module=self._module(), site=site)
        origin.deliberate = kind == INF and constant  # an Inf written from a literal: a mask
        if constant:
            origin.facts["literal"] = True
        if inf_from:
            real = [o for o in inf_from if o.source != "constant"]
            origin.from_inf = min(real, key=lambda o: o.seq) if real else Origin("constant", deliberate=True)
            origin.facts["inf_in"] = True
        origin.facts.update(_input_facts(inputs, scalars))
        origin.facts.update(_op_facts(name, args, kwargs, out))
        origin.facts["made"] = kind
        return origin

    def _module(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def _call_name(self, name: str) -> str:
        call = self._current_call() if self._current_call is not None else None
        return call or name


def _from_distributed() -> bool:
    """Whether the op was called by torch.distributed's own code (a frame of it on the stack before user code)."""

    def decides(frame: Any) -> bool:
        file = str(frame.f_code.co_filename).replace("\\", "/")
        return _DISTRIBUTED in file or ("/torch/" not in file and "/lightning_numguard/" not in file)

    found = first_frame(caller_frame(3), decides)
    return found is not None and _DISTRIBUTED in str(found.f_code.co_filename).replace("\\", "/")


def _input_facts(inputs: list[torch.Tensor], scalars: list[float]) -> dict[str, Any]:
    """What the op read: the largest finite ``|x|`` (an overflow from finite values shows it near the dtype's limit),
    and the smallest and largest finite values (``log`` of a negative, ``acos`` of 1.0000001, an exponent of 1146)."""
    values = [v for v in scalars if math.isfinite(v)]
    peaks, lows, highs = [abs(v) for v in values], list(values), list(values)
    with torch.no_grad():
        for t in inputs:
            x = local(t).detach()
            if not x.is_floating_point() or not x.numel():
                continue
            finite = x[torch.isfinite(x)]
            if finite.numel():
                low, high = (float(v) for v in torch.stack(torch.aminmax(finite)).tolist())  # one host read
                lows.append(low)
                highs.append(high)
                peaks.append(max(abs(low), abs(high)))
            else:
                peaks.append(0.0)
    facts: dict[str, Any] = {"max_abs_in": max(peaks)} if peaks else {}
    if lows:
        facts.update(min_in=min(lows), max_in=max(highs))
    return facts


def _op_facts(name: str, args: Any, kwargs: Any, out: torch.Tensor) -> dict[str, Any]:
    """What the advice for a few ops needs beyond the values read: whether a divisor held 0, how many values a
    ``std``/``var`` reduced, which CTC targets need more frames than their input has, how many labels a
    ``nll_loss`` counted. Read on the host, at the op that made a non-finite value during the replay only; a call
    whose arguments are not as expected gives none (the advice is then worded without them)."""
    try:
        return _measure(name, args, kwargs, out)
    except Exception:  # a fact is an extra: the diagnosis never fails over one
        return {}


def _measure(name: str, args: Any, kwargs: Any, out: torch.Tensor) -> dict[str, Any]:
    with torch.no_grad():
        if name in ("div", "div_", "true_divide", "reciprocal", "remainder", "fmod"):
            divisor = args[0] if name == "reciprocal" else args[1] if len(args) > 1 else None
            if isinstance(divisor, torch.Tensor):
                return {"zero_divisor": bool((local(divisor) == 0).any())}
            return {"zero_divisor": divisor == 0} if isinstance(divisor, (int, float)) else {}
        if name in ("std", "var", "std_mean", "var_mean") and args and isinstance(args[0], torch.Tensor):
            correction = kwargs.get("correction", 1)
            reduced = args[0].numel() // max(out.numel(), 1)
            return {"reduced_over": int(reduced), "correction": float(1 if correction is None else correction)}
        if name == "_ctc_loss" and len(args) >= 4:
            return _ctc_facts(*args[1:4])
        if name in ("nll_loss_forward", "nll_loss2d_forward") and len(args) >= 5 and isinstance(args[1], torch.Tensor):
            target, ignore_index = local(args[1]), int(args[4])
            return {"labels_counted": int((target != ignore_index).sum()), "ignore_index": ignore_index}
    return {}


def _ctc_facts(targets: Any, input_lengths: Any, target_lengths: Any) -> dict[str, Any]:
    """The samples whose target needs more input frames than they have: one frame per label, and a blank between
    two equal labels in a row (CTC's loss is ``-log(0) = inf`` for them)."""
    frames = torch.as_tensor(input_lengths).reshape(-1).tolist()
    lengths = torch.as_tensor(target_lengths).reshape(-1).tolist()
    labels = local(targets) if isinstance(targets, torch.Tensor) else torch.as_tensor(targets)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    short: list[tuple[int, int]] = []
    for i, (have, length) in enumerate(zip(frames, lengths)):
        row = labels[i, :length] if labels.dim() == 2 else labels[starts[i] : starts[i] + length]
        needed = int(length) + int((row[1:] == row[:-1]).sum()) if length > 1 else int(length)
        if needed > have:
            short.append((needed, int(have)))
    if not short:
        return {}
    return {"short_samples": len(short), "frames_needed": short[0][0], "frames": short[0][1]}


def culprit_of(bad: Iterable[Origin | None]) -> Origin | None:
    """The culprit of a step, by definition: the rule, written here once.

    The culprit is **the first op, in execution order, that made a NaN or Inf none of its inputs held, and whose
    value reaches a bad value the step detected** (``bad``: the origins of the first module output that went
    non-finite and of the loss). Of each bad value the origin is taken (the op that made it, or the parameter,
    buffer or batch field that already held it); when that origin is a NaN made from ±Inf inputs whose Inf was
    made by accident (an overflow, ``x / 0``, ``log(0)``), the walk goes on to the op that made that Inf; when the
    Inf was deliberate (a literal ``-inf`` mask), the op that made NaN of it is the culprit (a fully masked softmax
    row). Of the bad values' culprits the earliest in execution order is the step's. Non-finite values that never
    reach a detected bad value (T5's ``log(0)`` in its position buckets, a causal mask's ``-inf``) are never
    culprits. ``None``: nothing to blame (no bad value had an origin).
    """
    culprits = [Provenance.culprit(o) for o in bad if o is not None]
    return min(culprits, key=lambda o: o.seq) if culprits else None
