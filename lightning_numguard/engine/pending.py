"""Zero-sync building blocks: a flag read one step late, a skip decided on the device, late snapshots.

The guard's normal loop reads its packed flag vector on the host once per step, which stalls the
device queue. These pieces let a loop read nothing on the step it checks:

* :class:`PendingFlags` copies the step's flags to (pinned) host memory without blocking and hands
  them back one step later, when the copy has long landed;
* :func:`arm_device_skip` makes the coming ``optimizer.step()`` a bitwise no-op when a device flag
  is set, through the ``found_inf`` tensor that fused optimizers read (the GradScaler mechanism);
* :class:`LateSnapshots` keeps snapshots until the flags of the step they were taken after have
  been read, so a rollback decided one step late restores a state that was verified.

torch and the standard library only.
"""

from __future__ import annotations

import array
import ctypes
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from lightning_numguard import _compat

__all__ = ["LateSnapshots", "PendingFlags", "arm_device_skip", "disarm_device_skip", "supports_device_skip"]

T = TypeVar("T")


class PendingFlags:
    """A step's flag vector, copied to host memory without blocking and read one step later.

    :meth:`push` starts the copy of step ``n``'s float32 flags into a host buffer (pinned, with a
    CUDA event behind the copy, when the flags live on a GPU; a plain copy on the CPU) and returns
    the flags of the step pushed before, read from host memory: no ``Tensor`` read method is
    called and, on a GPU, the copy of the previous step finished a whole step ago (the event is
    waited on only if it has not, which a step of work makes rare).

    Two host buffers alternate, so the buffer being read is never the one being written.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[Any] = [None, None]
        self._steps: list[int | None] = [None, None]
        self._turn = 0

    def push(self, flags: torch.Tensor, step: int) -> tuple[int, list[float]] | None:
        """Start copying ``flags`` (step ``step``) to the host; return the previous step's flags, if any."""
        flags = flags.detach().reshape(-1).to(torch.float32)
        if not self._buffers or self._buffers[0].numel() != flags.numel():
            pin = flags.device.type == "cuda"
            self._buffers = [torch.empty(flags.numel(), dtype=torch.float32, pin_memory=pin) for _ in range(2)]
            self._events, self._steps = [None, None], [None, None]
        previous = self.pop()
        i = self._turn
        self._buffers[i].copy_(flags, non_blocking=flags.device.type == "cuda")
        if flags.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events[i] = event
        self._steps[i] = step
        self._turn = 1 - i
        return previous

    def pop(self) -> tuple[int, list[float]] | None:
        """The flags of the latest :meth:`push`, if not read yet (at the end of a fit: what is still pending)."""
        i = 1 - self._turn
        step = self._steps[i]
        if step is None:
            return None
        event = self._events[i]
        if event is not None and not event.query():
            event.synchronize()  # only if a whole step of work did not cover the copy
        buf = self._buffers[i]
        values = array.array("f", ctypes.string_at(buf.data_ptr(), buf.numel() * 4)).tolist()
        self._steps[i] = None
        return step, values


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf``: torch's fused implementations do."""
    return _compat.step_honours_found_inf(optimizer)


def arm_device_skip(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """Make the next ``optimizer.step()`` a bitwise no-op where ``bad`` (a 0-d device tensor) is true.

    Sets ``optimizer.found_inf`` (and ``grad_scale = None``, so the gradients are not unscaled) the
    way ``torch.amp.GradScaler`` does: the fused kernel leaves weights, moments and ``step``
    unchanged when ``found_inf`` is 1, with no host read. Call :func:`disarm_device_skip` after the
    step. Raises ``ValueError`` for an optimizer that would ignore the flag.
    """
    if not supports_device_skip(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__} ignores `found_inf`; a device-side skip needs a fused optimizer "
            "(e.g. torch.optim.AdamW(..., fused=True)); use the default sync mode otherwise"
        )
    _compat.set_found_inf(optimizer, bad)


def disarm_device_skip(optimizer: torch.optim.Optimizer) -> None:
    """Remove what :func:`arm_device_skip` set (GradScaler deletes its attributes the same way)."""
    _compat.clear_found_inf(optimizer)


class LateSnapshots(Generic[T]):
    """Snapshots that become usable once the step they were taken after is read as clean.

    With flags read one step late, a snapshot taken after step ``n`` is unverified until step
    ``n``'s flags are read (at step ``n + 1``). :meth:`add` keeps it as a candidate;
    :meth:`verified` promotes every candidate up to a step read as clean; :meth:`discard_from`
    drops candidates taken at or after a bad step. :attr:`last` is what a rollback restores.
    """

    def __init__(self) -> None:
        self._candidates: deque[tuple[int, T]] = deque()
        self.last: tuple[int, T] | None = None

    def add(self, step: int, snapshot: T) -> None:
        """A snapshot of the state after step ``step`` (unverified until that step's flags are read)."""
        self._candidates.append((step, snapshot))

    def verified(self, step: int) -> None:
        """Step ``step`` was read clean: candidates taken after it (or before) are now verified."""
        while self._candidates and self._candidates[0][0] <= step:
            self.last = self._candidates.popleft()

    @property
    def candidates(self) -> list[tuple[int, T]]:
        """The snapshots not verified yet, oldest first."""
        return list(self._candidates)

    def discard_from(self, step: int) -> None:
        """Step ``step`` was bad: candidates taken after it hold its damage."""
        self._candidates = deque((s, x) for s, x in self._candidates if s < step)

    def restore(self, apply: Callable[[T], None]) -> int:
        """Apply the last verified snapshot; returns the step it was taken after."""
        if self.last is None:
            raise RuntimeError("no verified snapshot to roll back to; take one at fit start")
        apply(self.last[1])
        return self.last[0]
