"""Forward hooks that record each module's output range on the device, without syncing."""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

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


class _Hook:
    """A forward hook bound weakly to its watch.

    ``copy.deepcopy(model)`` (EMA, SWA) copies hooks along with the model; the weak
    reference is shared, not copied, and the ``id`` check makes the copy's hooks inert.
    """

    __slots__ = ("module_id", "slot", "watch")

    def __init__(self, watch: OutputWatch, slot: int, module_id: int) -> None:
        self.watch = weakref.ref(watch)
        self.slot = slot
        self.module_id = module_id

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        watch = self.watch()
        if watch is None or id(module) != self.module_id:
            return
        watch.record_output(self.slot, output)


class _Slots:
    """A preallocated ``[n, 2]`` (min, max) buffer of one device and dtype, with a view pair per slot.

    ``torch.aminmax(out, out=views[slot])`` writes a module's range into its row: one kernel, no new tensor, no
    Python allocation beyond the call.
    """

    __slots__ = ("fresh", "stale", "values", "views")

    def __init__(self, n: int, device: torch.device, dtype: torch.dtype) -> None:
        self.values = torch.zeros(n, 2, device=device, dtype=dtype)
        self.views = [(row[0], row[1]) for row in self.values.unbind(0)]
        self.fresh: set[int] = set()  # rows written in this step
        self.stale: set[int] = set()  # rows written in an earlier step (their block has not run since)

    def clear_stale(self) -> None:
        """Zero the rows an earlier step wrote and this one did not (a block that did not run): none in the usual
        step, where every watched block runs, so no kernel."""
        old = self.stale - self.fresh
        if old:
            self.values[sorted(old)] = 0
        self.stale = set()


class OutputWatch:
    """Records, per forward call of each watched module, the min and max of its floating outputs.

    The first output of each watched module in a step goes into its row of a preallocated device
    buffer (one per device and dtype; a row its block did not write in a step reads 0) through
    ``torch.aminmax(out=...)``;
    further calls of the same module in the step (a shared module, gradient accumulation) and
    further floating leaves of a structured output are kept as extra records. Nothing is read
    back: :meth:`total` folds everything into one 0-d value that is non-finite when any watched
    output was, and :meth:`first_bad` (which syncs; use after a hit) names the first module in
    execution order.

    A module's output that is the very tensor already recorded (a ``Sequential`` returning its
    last child's output) is not reduced twice.

    Args:
        root: the module whose submodules are watched.
        include: glob patterns of qualified names to watch.
        exclude: glob patterns of qualified names not to watch.
        depth: watch blocks rather than every module (see :func:`select_modules`); ``None``
            watches every module.
        max_per_list: with ``depth``, at most about this many elements of one long
            ``ModuleList``/``ModuleDict`` are watched (see :func:`select_modules`).

    Attributes:
        records: ``(slot, where)`` per recorded output in execution order: ``where`` is the
            buffer key ``(device, dtype)`` for a row of a preallocated buffer, or the
            ``(min, max)`` pair of an extra record.
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
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._last_out: torch.Tensor | None = None
        self._buffers: dict[tuple[torch.device, torch.dtype], _Slots] = {}
        self._used = [False] * len(modules)  # a list: dynamo cannot subscript a bytearray
        self.records: list[tuple[int, Any]] = []
        self.enabled = True

    def attach(self) -> None:
        """Register the hooks (idempotent). Do it before the first compiled forward."""
        if self._handles:
            return
        for slot, ref in enumerate(self._modules):
            module = ref()
            if module is None:
                continue
            self._handles.append(module.register_forward_hook(_Hook(self, slot, id(module))))

    def detach(self) -> None:
        """Remove every hook this watch registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.reset()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def reset(self) -> None:
        """Forget the records of the current step. No kernel: a row the next step does not write again is zeroed
        when that step is totalled (:meth:`total`), and only then."""
        if self.records:
            for slots in self._buffers.values():
                slots.stale |= slots.fresh
                slots.fresh = set()
            self.records.clear()
            self._used = [False] * len(self.names)
        self._last_out = None

    def record_output(self, slot: int, output: Any) -> None:
        if not self.enabled or not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):
            if output is self._last_out or not output.is_floating_point():
                return
            self._last_out = output
            # a DTensor output: this rank's shard (the flags are all-reduced); a plain tensor skips the lookup
            shard = output.detach() if type(output) is torch.Tensor else local(output.detach())
            if shard.numel():
                self._record(slot, shard)
            return
        for _, t in floating_leaves(output, "out"):
            shard = local(t.detach())
            if shard.numel():
                self._record(slot, shard)

    def _record(self, slot: int, t: torch.Tensor) -> None:
        if self._used[slot]:  # a second output of this module in the step: an extra record
            self.records.append((slot, torch.aminmax(t)))
            return
        self._used[slot] = True
        key = (t.device, t.dtype)
        slots = self._buffers.get(key)
        if slots is None:  # once per device and dtype
            slots = self._buffers[key] = _Slots(len(self.names), t.device, t.dtype)
        torch.aminmax(t, out=slots.views[slot])  # one kernel per watched output (see checks._extremes)
        slots.fresh.add(slot)
        self.records.append((slot, key))

    def total(self, device: torch.device) -> torch.Tensor:
        """0-d float32: the sum of every recorded min and max (no sync).

        Non-finite when any output was; finite values can only overflow it into a false
        candidate, which :meth:`first_bad` then clears.
        """
        self._settle()
        if not self.records:
            return torch.zeros((), dtype=torch.float32, device=device)
        # max-|x| in each buffer's own dtype, then to float32 with finite float64 values clamped: NaN and
        # Inf propagate, huge finite values (1e100 under 64-true) never look non-finite
        # max-|x| in one kernel (the inf-norm propagates NaN, on the CPU and on CUDA)
        parts = [as_f32(torch.linalg.vector_norm(s.values, float("inf"))) for s in self._buffers.values()]
        if any(p.device != device for p in parts):
            parts = [p.to(device, non_blocking=True) for p in parts]
        extras = [t for _, where in self.records if isinstance(where[0], torch.Tensor) for t in where]
        if extras:
            parts.append(as_f32(torch.stack([t.to(device).double() for t in extras]).abs().amax()))
        return parts[0] if len(parts) == 1 else torch.stack(parts).amax()

    def _settle(self) -> None:
        """Rows of blocks that did not run in this step: zero, not an earlier step's range."""
        for slots in self._buffers.values():
            slots.clear_stale()

    def _values(self, device: torch.device) -> list[tuple[float, float]]:
        """Each record's (min, max) on the host. **Syncs.**"""
        rows = {key: s.values.float().tolist() for key, s in self._buffers.items()}
        out: list[tuple[float, float]] = []
        for slot, where in self.records:
            if isinstance(where[0], torch.Tensor):
                lo, hi = (float(t) for t in where)
            else:
                lo, hi = rows[where][slot]
            out.append((lo, hi))
        return out

    def record_tensors(self, start: int = 0, stop: int | None = None) -> list[torch.Tensor]:
        """The device (min, max) tensors of ``records[start:stop]``, in order (no sync)."""
        out: list[torch.Tensor] = []
        for slot, where in self.records[start:stop]:
            out.extend(where if isinstance(where[0], torch.Tensor) else self._buffers[where].views[slot])
        return out

    def ranges(self) -> list[tuple[tuple[torch.device, torch.dtype], torch.Tensor]]:
        """This step's ``[blocks, 2]`` (min, max) buffer per (device, dtype) of output, zeros where a block did
        not record (no sync; read by the overflow headroom of ``core/spike.py``)."""
        self._settle()
        return [(key, s.values) for key, s in self._buffers.items()]

    def keep(self) -> tuple[list[tuple[int, Any]], dict[tuple[torch.device, torch.dtype], torch.Tensor]]:
        """This step's records and a device copy of its buffers, for :meth:`first_bad` a step later (no sync)."""
        self._settle()
        return list(self.records), {key: s.values.clone() for key, s in self._buffers.items()}

    def first_bad(
        self, kept: tuple[list[tuple[int, Any]], dict[Any, torch.Tensor]] | None = None
    ) -> list[tuple[str, float, float]]:
        """Modules whose output went non-finite, first in execution order, with (min, max). **Syncs.**

        ``kept``: what :meth:`keep` returned for an earlier step, instead of the current records.
        """
        records = self.records if kept is None else kept[0]
        if not records:
            return []
        if kept is None:
            values = self._values(torch.device("cpu"))
        else:
            rows = {key: t.float().tolist() for key, t in kept[1].items()}
            values = [
                (float(where[0]), float(where[1])) if isinstance(where[0], torch.Tensor) else tuple(rows[where][slot])
                for slot, where in records
            ]
        seen: set[int] = set()
        bad = []
        for (slot, _), (lo, hi) in zip(records, values):
            if slot in seen:
                continue
            if not (_finite(lo) and _finite(hi)):
                seen.add(slot)
                bad.append((self.names[slot], lo, hi))
        return bad


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))
