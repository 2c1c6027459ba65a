"""Forward hooks that record each watched module's output on the device, without syncing.

Eager, a hook only keeps a reference to the output; the step reduces every output it kept in one
``_foreach_norm(ord=inf)`` per device and dtype (:meth:`OutputWatch.settle`), so the kernels do not grow with
the number of watched blocks. Inside a ``torch.compile``d region a hook traces a max-|x| over the output's last
dimension, a reduction over the value just computed that inductor fuses into the kernel producing it, and keeps
the small result on the hook object itself, written as an attribute (which dynamo hands back as a graph output):
nothing a hook touches is created during the first compiled call, so no guard fails at the second step
(``docs/performance.md``, "Compiled models").
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_numguard._compat import foreach_max_abs, graph_task_id, set_grad_enabled, tracing_a_subgraph
from lightning_numguard.detect.checks import as_f32
from lightning_numguard.dtensor import local
from lightning_numguard.tree import floating_leaves

__all__ = ["MAX_PER_LIST", "PASS_THROUGH", "OutputWatch", "select_modules"]

#: Default cap on the watched elements of one ``ModuleList``/``ModuleDict`` (see :func:`select_modules`).
MAX_PER_LIST = 16


#: Stateless modules whose output is finite whenever their input is (short of exceeding float32's range):
#: a NaN or Inf they pass on is already in the output of the block before them, or in the step's
#: input. At block granularity (``depth``) they are not watched; the replay after a hit, watching
#: every module, still sees them. Exact types only: a subclass may compute anything.
PASS_THROUGH: frozenset[type[nn.Module]] = frozenset(
    {
        nn.Identity,
        nn.ReLU,
        nn.ReLU6,
        nn.GELU,
        nn.SiLU,
        nn.Tanh,
        nn.Sigmoid,
        nn.Hardtanh,
        nn.Hardsigmoid,
        nn.Hardswish,
        nn.Softmax,
        nn.Dropout,
        nn.Dropout1d,
        nn.Dropout2d,
        nn.Dropout3d,
        nn.Flatten,
        nn.Unflatten,
        nn.MaxPool1d,
        nn.MaxPool2d,
        nn.MaxPool3d,
    }
)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_LISTS = (nn.ModuleList, nn.ModuleDict)


def select_modules(
    root: nn.Module,
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    depth: int | None = None,
    max_per_list: int | None = MAX_PER_LIST,
) -> list[tuple[str, nn.Module]]:
    """The ``(qualified_name, module)`` pairs of ``root`` matching ``include`` and not ``exclude``.

    Patterns are :mod:`fnmatch` globs on qualified names (``"encoder.*"``, ``"*.norm"``); the root
    itself is named ``""`` and is never watched (its output is the loss-side of the step).

    ``depth`` picks *blocks* instead of every module: a module is a candidate when it lies at most
    ``depth`` levels below the root, counting containers (``Sequential``, ``ModuleList``,
    ``ModuleDict``) as transparent, or when it is an element of a ``ModuleList``/``ModuleDict``
    (a repeated block: a transformer layer) not inside another such element. ``ModuleList`` and
    ``ModuleDict`` themselves have no forward and are never watched; a transparent ``Sequential``
    is not watched either (its output is its last element's). Only the outermost ``Sequential`` of
    a nest is transparent: a ``Sequential`` that is an element of a transparent container is a
    block (a conv-BatchNorm-ReLU stage), and its own elements lie one level deeper. A module matched by an
    ``include`` pattern other than ``"*"`` is a candidate at any depth. ``None`` makes every
    module a candidate.

    With ``depth``, modules of the :data:`PASS_THROUGH` types (activations, dropout, pooling by
    maximum, ``Flatten``) are not blocks: they cannot turn finite values into NaN or Inf, so what
    they pass on was already in the previous block's output. An ``include`` pattern other than
    ``"*"`` can still name them.

    ``max_per_list`` (with ``depth`` only) caps the watched elements of one long
    ``ModuleList``/``ModuleDict``: of ``n > max_per_list`` elements, every ``ceil(n / max_per_list)``-th
    one and the last are watched. A bad value propagates through the following blocks, so it is
    still caught, at the next watched block; the replay after a hit names the exact module. An
    element an explicit ``include`` pattern names is watched regardless. ``None``: no cap.
    """
    explicit = [p for p in include if p != "*"]

    def wanted(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
            fnmatch.fnmatchcase(name, p) for p in exclude
        )

    if depth is None:
        return [(n, m) for n, m in root.named_modules() if n and wanted(n)]
    chosen: list[tuple[str, nn.Module]] = []
    seen: set[int] = {id(root)}

    def visit(module: nn.Module, prefix: str, level: int, in_block: bool, in_container: bool) -> None:
        # ModuleList/ModuleDict have no forward: always transparent. A Sequential is transparent (its elements
        # are the blocks, at its own level) unless it is itself an element of a transparent container: then
        # it is a block (a conv-BN-ReLU stage) and its insides are one level deeper.
        element = isinstance(module, _LISTS)
        transparent = module is not root and (element or (isinstance(module, nn.Sequential) and not in_container))
        n = len(module) if isinstance(module, _LISTS) else 0  # an element list's length; others need no stride
        stride = -(-n // max_per_list) if element and max_per_list and n > max_per_list else 1
        for i, (child_name, child) in enumerate(module.named_children()):
            if id(child) in seen:
                continue
            seen.add(id(child))
            name = f"{prefix}{child_name}"
            child_level = level if transparent else level + 1
            child_in_container = transparent or (module is root and isinstance(module, _CONTAINERS))
            block = child_level <= depth or (element and not in_block)
            if stride > 1 and (i + 1) % stride and i != n - 1:
                block = False  # a long list: every stride-th element and the last
            if type(child) in PASS_THROUGH or (isinstance(child, nn.Sequential) and not child_in_container):
                block = False  # passes on what the block before saw / a transparent Sequential: its last element's
            candidate = block or any(fnmatch.fnmatchcase(name, p) for p in explicit)
            if candidate and not isinstance(child, _LISTS) and wanted(name):
                chosen.append((name, child))
            visit(child, f"{name}.", child_level, in_block or element, child_in_container)

    visit(root, "", 0, False, False)
    return chosen


class _Nothing:
    pass


_ROWS = operator.attrgetter("rows")  # a hook's rows from compiled regions (any() of them: no Python loop)
_SLOT, _OUTPUT = operator.itemgetter(1), operator.itemgetter(2)  # of a pending eager call: (stamp, slot, output)
_DEVICE, _DTYPE = operator.attrgetter("device"), operator.attrgetter("dtype")
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling  # one lookup (dynamo folds the call by the function itself)
_dead_ref: weakref.ref[Any] = weakref.ref(_Nothing())  # dead at once: what a deep copy's hooks hold


@torch.compiler.assume_constant_result
def _in_subgraph() -> bool:
    """Inside a compiled region, whether this hook runs in the body of a higher-order op (activation checkpointing):
    evaluated once, when dynamo traces the call (see :func:`~lightning_numguard._compat.tracing_a_subgraph`)."""
    return tracing_a_subgraph()


class _Hook:
    """A forward hook bound weakly to its watch; what a compiled region recorded waits on it.

    ``copy.deepcopy(model)`` (EMA, SWA) copies hooks along with the model: the copy's hook is inert
    (:meth:`__deepcopy__`); eager, the ``id`` check also leaves out a module that shares this one's hooks dict.

    Inside a compiled region the hook cannot append to a list or fill a dict (dynamo would guard on their contents
    and compile the graph again when they change): it replaces three tuples of its own, one entry per call, that
    dynamo writes back after the graph runs. They are empty again whenever a compiled region starts (the watch
    empties them when it settles, before the next step's forward), so the guards dynamo puts on them hold at every
    step.

    Attributes:
        rows: per call inside a compiled region, the output's max-|x| over its last dimension (float32; float64
            for float64 outputs), a small device tensor; empty outside.
        stamps: per call, its position among the step's recorded calls (execution order).
        dtypes: per call, the output's dtype.
    """

    __slots__ = ("dtypes", "module_id", "rows", "slot", "stamps", "watch")

    def __init__(self, watch: OutputWatch, slot: int, module_id: int) -> None:
        self.watch = weakref.ref(watch)
        self.slot = slot
        self.module_id = module_id
        self.rows: tuple[torch.Tensor, ...] = ()
        self.stamps: tuple[int, ...] = ()
        self.dtypes: tuple[torch.dtype, ...] = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        watch = self.watch()
        if watch is None:
            return
        # compiled: no identity check (a guard on the module's id would compile a shared block's graph once per
        # block); a deep copy's hooks are inert anyway (__deepcopy__)
        if _is_compiling():
            watch.record_output(self, output)
        elif id(module) == self.module_id:
            watch.record_eager(self, output)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        """A deep copy of the model (EMA, SWA) gets an inert hook: its outputs are not this watch's."""
        copy = _Hook.__new__(_Hook)
        copy.watch, copy.slot, copy.module_id = _dead_ref, self.slot, -1
        copy.clear()
        return copy

    def clear(self) -> None:
        self.rows, self.stamps, self.dtypes = (), (), ()


def row_peaks(t: torch.Tensor) -> torch.Tensor:
    """``t``'s max-|x| over its last dimension (NaN propagates), in float32 (float64 for float64 ``t``; complex: the
    modulus).

    The form a compiled hook traces: a reduction over the last dimension has the iteration space of the kernel that
    computes a block's output (a LayerNorm's rows, a pointwise epilogue), so inductor computes it in that kernel's
    loop over the value just produced, instead of a kernel of its own; its result has one value per row.
    """
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(t, math.inf, dim=-1, dtype=torch.float32)
    return torch.linalg.vector_norm(t, math.inf, dim=-1)


def _max_abs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per tensor, its max-|x| as a 0-d float32 tensor on the first tensor's device, in order: one
    ``_foreach_norm(ord=inf)`` per (device, dtype). Finite float64 values beyond float32's range give float32's
    max (finite), never ``inf``; no sync."""
    if len(set(zip(map(_DEVICE, tensors), map(_DTYPE, tensors)))) == 1:  # the usual: one call, in order
        peaks = foreach_max_abs(tensors)
        return peaks if peaks[0].dtype == torch.float32 else list(as_f32(torch.stack(peaks)).unbind())
    dtypes = list(map(_DTYPE, tensors))
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, key in enumerate(zip(map(_DEVICE, tensors), dtypes)):
        groups.setdefault(key, []).append(i)
    device = tensors[0].device
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for (dev, _), members in groups.items():
        peaks = foreach_max_abs([tensors[i] for i in members])
        if peaks[0].dtype != torch.float32:  # float64 (or complex128): clamped once for the whole group
            peaks = list(as_f32(torch.stack(peaks)).unbind())
        if dev != device:
            peaks = [p.to(device, non_blocking=True) for p in peaks]
        for i, p in zip(members, peaks):
            out[i] = p
    return [p for p in out if p is not None]


def _peaks_of(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`_max_abs` of outputs kept as they are (not detached), without grad: autograd's own switch around the
    reduction, not a ``no_grad`` context, which cost more than the detach a call it saves."""
    grad = _grad_enabled()
    set_grad_enabled(False)
    try:
        return _max_abs(outputs)
    finally:
        set_grad_enabled(grad)


class OutputWatch:
    """Records, per forward call of each watched module, the max-|x| of its floating outputs, on the device.

    Nothing is read back: :meth:`values` are the step's records, one 0-d value each, which one process's read lays
    in its one vector as they are; :meth:`total` folds them into one 0-d value that is non-finite when any watched
    output was (the read of several ranks, and the deferred read); :meth:`first_bad` (which syncs; use after a hit)
    names the first bad module in execution order.

    Eager, a hook keeps the output (as it is: no detach) and its place in the step; :meth:`settle` reduces what the
    hooks kept, without grad, to one max-|x| per call, with one ``_foreach_norm(ord=inf)`` per device and dtype,
    whatever the number of watched blocks, and drops the references (the step settles at its loss, before the
    backward pass, and at its read). Inside a ``torch.compile``d region a hook traces :func:`row_peaks` of the
    output, fused by inductor into the kernel that computes the output, and leaves the small result on its hook
    (:class:`_Hook`); the same :meth:`settle` reduces those rows. Every call is a record of its own, in execution
    order across eager code and compiled regions (a shared module, accumulation). Activation checkpointing's
    recomputation in the backward pass is not recorded (the same values again), nor, under ``torch.compile``, a call
    inside a checkpointed function (dynamo would give up the whole frame).

    A module's output that is the very tensor already recorded (a ``Sequential`` returning its last child's output)
    is not recorded twice (eager; a compiled region records it again, and inductor reads it once).

    Args:
        root: the module whose submodules are watched.
        include: glob patterns of qualified names to watch.
        exclude: glob patterns of qualified names not to watch.
        depth: watch blocks rather than every module (see :func:`select_modules`); ``None``
            watches every module.
        max_per_list: with ``depth``, at most about this many elements of one long
            ``ModuleList``/``ModuleDict`` are watched (see :func:`select_modules`).

    Attributes:
        names: the watched modules' qualified names; a module's slot is its index here.
    """

    def __init__(
        self,
        root: nn.Module,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] = (),
        depth: int | None = None,
        max_per_list: int | None = MAX_PER_LIST,
    ) -> None:
        modules = select_modules(root, include, exclude, depth, max_per_list)
        self.names: list[str] = [n for n, _ in modules]
        self._modules = [weakref.ref(m) for _, m in modules]
        self._hooks = [_Hook(self, slot, id(m)) for slot, (_, m) in enumerate(modules)]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._last_out: torch.Tensor | None = None
        self._calls = 0  # calls recorded since the last settle: the next call's stamp
        self._pending: list[tuple[int, int, torch.Tensor]] = []  # eager calls not settled: (stamp, slot, output)
        self._records: list[tuple[int, tuple[int, int, torch.dtype]]] = []
        self._peaks: list[list[torch.Tensor]] = []  # per settle, a 0-d float32 max-|x| per call, in execution order
        self._zeros: dict[torch.device, torch.Tensor] = {}  # read outside compiled regions only
        self.enabled = True

    def attach(self) -> None:
        """Register the hooks (idempotent). Do it before the first compiled forward: a compiled region traces the
        hooks it finds then."""
        if self._handles:
            return
        for hook, ref in zip(self._hooks, self._modules):
            module = ref()
            if module is None:
                continue
            self._handles.append(module.register_forward_hook(hook))

    def detach(self) -> None:
        """Remove every hook this watch registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.reset()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @property
    def records(self) -> list[tuple[int, tuple[int, int, torch.dtype]]]:
        """``(slot, (settle, index, dtype))`` per recorded call, in execution order (what was not settled yet is
        settled first: no sync). The list itself: deleting a prefix forgets those calls."""
        self.settle()
        return self._records

    def count(self) -> int:
        """How many calls the step has recorded (:attr:`records`' length; what was not settled yet is settled first)."""
        if self._calls:
            self.settle()
        return len(self._records)

    def reset(self) -> None:
        """Forget the records of the current step. No kernel."""
        self._last_out = None
        if not self._calls and not self._peaks:  # nothing recorded, pending or settled (a step's second reset)
            return
        self._pending.clear()
        if any(map(_ROWS, self._hooks)):  # a compiled region's rows not settled
            for hook in self._hooks:
                if hook.rows:
                    hook.clear()
        self._calls = 0
        self._records.clear()
        self._peaks.clear()

    def record_output(self, hook: _Hook, output: Any) -> None:
        """One forward call of ``hook``'s module: keep its floating outputs (eager) or trace their row peaks
        (compiled)."""
        if not torch.compiler.is_compiling():
            self.record_eager(hook, output)
            return
        if not self.enabled or not torch.is_grad_enabled():
            return
        if not _in_subgraph():  # a checkpointed block under torch.compile: no record (the next block sees it)
            self._trace(hook, output)

    def record_eager(self, hook: _Hook, output: Any) -> None:
        """:meth:`record_output` outside a compiled region (the hook's own path there: one check fewer a call)."""
        if not (self.enabled and _grad_enabled()) or graph_task_id() != -1:
            return  # in backward: activation checkpointing's recompute, the forward's values again, kept till the read
        if type(output) is torch.Tensor:  # the usual: a plain tensor
            if output is not self._last_out and output.is_floating_point() and output.numel():
                self._last_out = output
                self._pending.append((self._calls, hook.slot, output))  # as it is: settle reduces it without grad
                self._calls += 1
            return
        if isinstance(output, torch.Tensor):  # a DTensor output: this rank's shard (the flags are all-reduced)
            if output is self._last_out or not output.is_floating_point():
                return
            self._last_out = output
            shard = local(output.detach())
            if shard.numel():
                self._pending.append((self._calls, hook.slot, shard))
                self._calls += 1
            return
        for _, t in floating_leaves(output, "out"):
            shard = local(t.detach())
            if shard.numel():
                self._pending.append((self._calls, hook.slot, shard))
                self._calls += 1

    def _trace(self, hook: _Hook, output: Any) -> None:
        """Inside a compiled region: no list, dict or buffer is created or filled, only ``hook``'s tuples replaced
        and the call counter moved (see :class:`_Hook`)."""
        leaves = [output] if isinstance(output, torch.Tensor) else [t for _, t in floating_leaves(output, "out")]
        for t in leaves:
            if not t.is_floating_point() and not t.is_complex():
                continue
            shard = t.detach() if type(t) is torch.Tensor else local(t.detach())
            if shard.numel() == 0:
                continue
            hook.rows = (*hook.rows, row_peaks(shard))
            hook.stamps = (*hook.stamps, self._calls)
            hook.dtypes = (*hook.dtypes, shard.dtype)
            self._calls += 1

    def settle(self) -> None:
        """Reduce the calls recorded since the last settle to one max-|x| each, in execution order, and drop the
        references to their outputs (no sync; nothing to do when nothing was recorded). Eager outputs and the rows
        of compiled regions alike go through one ``_foreach_norm(ord=inf)`` per device and dtype."""
        self._last_out = None
        if not self._calls:  # nothing recorded since the last settle (most calls): every record moves the counter
            return
        self._calls = 0
        pending, hooks = self._pending, self._hooks
        if not any(map(_ROWS, hooks)):  # eager calls only (the usual): in execution order already
            index = len(self._peaks)
            outputs = list(map(_OUTPUT, pending))
            self._peaks.append(_peaks_of(outputs))  # 0-d values, each a tensor of its own
            places = zip(itertools.repeat(index), itertools.count(), map(_DTYPE, outputs))  # (settle, index, dtype)
            self._records.extend(zip(map(_SLOT, pending), places))
            pending.clear()
            return
        index = len(self._peaks)
        calls = [(stamp, slot, t, t.dtype) for stamp, slot, t in pending]
        pending.clear()
        for hook in hooks:
            if hook.rows:
                calls.extend(zip(hook.stamps, [hook.slot] * len(hook.rows), hook.rows, hook.dtypes))
                hook.clear()
        calls.sort(key=lambda c: c[0])  # eager calls come sorted; compiled ones join them in place
        self._peaks.append(_peaks_of([t for _, _, t, _ in calls]))
        self._records.extend((slot, (index, i, dtype)) for i, (_, slot, _, dtype) in enumerate(calls))

    def values(self, device: torch.device) -> list[torch.Tensor]:
        """The 0-d float32 max-|x| of this step's records on ``device``, in order (no kernel where they are there
        already, no sync): one process's read lays them in its one vector and the host takes their max."""
        if self._calls:
            self.settle()
        records = self._records
        if not records:
            return []
        live = self._peaks[records[0][1][0] :]  # the settles of the records not forgotten (a prefix is dropped)
        out = live[0] if len(live) == 1 else [p for peaks in live for p in peaks]
        return out if out[0].device == device else [p.to(device, non_blocking=True) for p in out]

    def total(self, device: torch.device) -> torch.Tensor:
        """0-d float32: the largest max-|x| of this step's records (no sync). Non-finite when any recorded output
        was; finite float64 values beyond float32's range count as float32's max."""
        values = self.values(device)
        if not values:
            return torch.zeros((), dtype=torch.float32, device=device)
        return values[0] if len(values) == 1 else torch.stack(values).amax()

    def record_tensors(self, start: int = 0, stop: int | None = None) -> list[torch.Tensor]:
        """The 0-d max-|x| device tensors of ``records[start:stop]``, in order (views: no kernel, no sync)."""
        return [self._peaks[b][i] for _, (b, i, _) in self.records[start:stop]]

    def ranges(self) -> list[tuple[tuple[torch.device, torch.dtype], torch.Tensor]]:
        """Per (device, dtype) of output, this step's ``[blocks, 1]`` max-|x| per watched block (its largest call),
        zeros where a block did not record in that dtype (no sync; read by the overflow headroom of
        ``detect/spike.py``). Two or three kernels per dtype: a ``stack`` of views and zeros, its ``amax``."""
        records = self.records
        if not records:
            return []
        n = len(self.names)
        by_dtype: dict[torch.dtype, list[list[torch.Tensor | None]]] = {}
        for slot, (b, i, dtype) in records:
            layers = by_dtype.setdefault(dtype, [])
            for layer in layers:  # the first layer with this block's row free (a block called k times: k layers)
                if layer[slot] is None:
                    layer[slot] = self._peaks[b][i]
                    break
            else:
                layer = [None] * n
                layer[slot] = self._peaks[b][i]
                layers.append(layer)
        device = self._peaks[0][0].device
        zero = self._zeros.get(device)
        if zero is None:  # a 0-d zero per device, made once (never written to)
            zero = self._zeros[device] = torch.zeros((), dtype=torch.float32, device=device)
        out = []
        for dtype, layers in by_dtype.items():
            rows = torch.stack([zero if p is None else p for layer in layers for p in layer]).view(len(layers), n)
            out.append(((device, dtype), (rows[0] if len(layers) == 1 else rows.amax(0)).unsqueeze(-1)))
        return out

    def host_ranges(self, values: Sequence[float]) -> list[tuple[tuple[torch.device, torch.dtype], list[float]]]:
        """:meth:`ranges` on the host, of :meth:`values` read back: per (device, dtype) of output, in the same order,
        each watched block's largest max-|x| (0.0 where it did not record in that dtype; NaN propagates). No op."""
        records = self.records
        if not records:
            return []
        first = records[0][1][0]
        starts, at = [0] * len(self._peaks), 0  # where each settle's values start in ``values``
        for b in range(first, len(self._peaks)):
            starts[b], at = at, at + len(self._peaks[b])
        device = self._peaks[first][0].device
        n = len(self.names)
        by_dtype: dict[torch.dtype, list[float]] = {}
        for slot, (b, i, dtype) in records:
            rows = by_dtype.get(dtype)
            if rows is None:
                rows = by_dtype[dtype] = [0.0] * n
            value, old = values[starts[b] + i], rows[slot]
            if old == old and not value <= old:  # larger, or NaN (which stays)
                rows[slot] = value
        return [((device, dtype), rows) for dtype, rows in by_dtype.items()]

    def keep(self) -> tuple[list[tuple[int, Any]], list[list[torch.Tensor]]]:
        """This step's records and their device values, for :meth:`first_bad` a step later (no sync, no kernel: each
        record's value is a tensor of its own, never written again)."""
        return list(self.records), list(self._peaks)

    def first_bad(
        self, kept: tuple[list[tuple[int, Any]], list[list[torch.Tensor]]] | None = None
    ) -> list[tuple[str, float]]:
        """``(name, max_abs)`` of each module whose output went non-finite, first in execution order. **Syncs**
        (one read of every record's value).

        ``kept``: what :meth:`keep` returned for an earlier step, instead of the current records.
        """
        records, peaks = (self.records, self._peaks) if kept is None else kept
        if not records:
            return []
        device = peaks[0][0].device
        values = torch.stack([p.to(device) for settled in peaks for p in settled]).tolist()  # the one read
        starts = [0]
        for p in peaks[:-1]:
            starts.append(starts[-1] + len(p))
        seen: set[int] = set()
        bad = []
        for slot, (b, i, _) in records:
            value = values[starts[b] + i]
            if slot not in seen and not math.isfinite(value):
                seen.add(slot)
                bad.append((self.names[slot], value))
        return bad
