"""Forward hooks that record each module's output range on the device, without syncing."""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .tree import floating_leaves

__all__ = ["OutputWatch", "select_modules"]


def select_modules(
    root: nn.Module, include: Sequence[str] = ("*",), exclude: Sequence[str] = ()
) -> list[tuple[str, nn.Module]]:
    """The ``(qualified_name, module)`` pairs of ``root`` matching ``include`` and not ``exclude``.

    Patterns are :mod:`fnmatch` globs on qualified names (``"encoder.*"``, ``"*.norm"``); the root
    itself is named ``""`` and is never watched (its output is the loss-side of the step).
    """
    chosen = []
    for name, module in root.named_modules():
        if not name:
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
            fnmatch.fnmatchcase(name, p) for p in exclude
        ):
            chosen.append((name, module))
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
        watch._exit(self.slot, output)


class OutputWatch:
    """Records, per forward call of each watched module, the min and max of its floating outputs.

    Nothing is read back: :meth:`total` folds the records into one 0-d value that is non-finite
    when any watched output was, and :meth:`first_bad` (which
    syncs; use after a hit) names the first module in execution order.

    A module's output that is the very tensor already recorded (a ``Sequential`` returning its
    last child's output) is not reduced twice.

    Args:
        root: the module whose submodules are watched.
        include: glob patterns of qualified names to watch.
        exclude: glob patterns of qualified names not to watch.
    """

    def __init__(
        self,
        root: nn.Module,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] = (),
    ) -> None:
        modules = select_modules(root, include, exclude)
        self.names: list[str] = [n for n, _ in modules]
        self._modules = [weakref.ref(m) for _, m in modules]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._last_out: torch.Tensor | None = None
        self.records: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]] = []
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
        """Forget the records of the current step."""
        self.records.clear()
        self._last_out = None

    def _exit(self, slot: int, output: Any) -> None:
        if not self.enabled or not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):
            if output is self._last_out or not output.is_floating_point() or output.numel() == 0:
                return
            self._last_out = output
            self.records.append((slot, torch.aminmax(output.detach())))
            return
        for _, t in floating_leaves(output, "out"):
            if t.numel():
                self.records.append((slot, torch.aminmax(t.detach())))

    def total(self, device: torch.device) -> torch.Tensor:
        """0-d float32: the sum of every recorded min and max (no sync).

        Non-finite when any output was; finite values can only overflow it into a false
        candidate, which :meth:`first_bad` then clears.
        """
        if not self.records:
            return torch.zeros((), dtype=torch.float32, device=device)
        return self._values(device).sum()

    def _values(self, device: torch.device) -> torch.Tensor:
        """``[n, 2]`` float32: each record's (min, max); one stack (cast only when dtypes differ)."""
        flat = [t for _, pair in self.records for t in pair]
        if any(t.device != device for t in flat):
            flat = [t.to(device, non_blocking=True) for t in flat]
        dtypes = {t.dtype for t in flat}
        if len(dtypes) > 1:
            flat = [t.float() for t in flat]
        return torch.stack(flat).view(-1, 2).float()

    def first_bad(self) -> list[tuple[str, float, float]]:
        """Modules whose output went non-finite, first in execution order, with (min, max). **Syncs.**"""
        if not self.records:
            return []
        values = self._values(self.records[0][1][0].device).tolist()
        seen: set[int] = set()
        bad = []
        for (slot, _), (lo, hi) in zip(self.records, values):
            if slot in seen:
                continue
            if not (_finite(lo) and _finite(hi)):
                seen.add(slot)
                bad.append((self.names[slot], lo, hi))
        return bad


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))
