"""A batch of tensor copies that runs while the caller goes on: the engine of asynchronous snapshots.

:func:`start` copies ``src[i]`` into ``dst[i]`` for every pair and returns a :class:`Copies` handle
at once. Three backends:

* ``"stream"`` (CUDA sources): the copies run on a side stream that first waits on an event
  recorded on the current stream (so they see every write queued before them); the sources (and
  device destinations) are marked with ``record_stream`` so the caching allocator keeps them alive
  for the side stream. :meth:`Copies.wait` makes the *current stream* wait on the side stream's done
  event: a device-side wait, no host stall; whatever is queued after it (the optimizer step) cannot
  overwrite a source before it is copied. :meth:`Copies.synchronize` blocks the host until the
  copies are done: needed before the host reads a pinned host destination (a restore, a gather,
  a checkpoint).
* ``"thread"`` (CPU): one background worker thread does the copies (torch ops release the GIL);
  :meth:`Copies.wait` joins it and re-raises what it raised.
* ``"sync"``: the copies are done before :func:`start` returns; waiting costs nothing.

:func:`plan_tree` is :func:`~.tree.clone_tree` without the copies: the destination tree (reusing an
earlier copy's storage where shape, dtype and device match) and the ``(dst, src)`` pairs to copy.

torch and the standard library only.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any, Literal

import torch

from lightning_numguard.tree import map_tree

__all__ = ["Backend", "Copies", "backend_for", "plan_tree", "start"]

Backend = Literal["stream", "thread", "sync"]


class Copies:
    """Copies in flight; :meth:`wait` orders later work after them, :meth:`synchronize` blocks the host."""

    def wait(self) -> None:
        """Order what the caller does next after the copies (idempotent)."""

    def synchronize(self) -> None:
        """Block the host until the copies are done (idempotent); the destinations may then be read."""
        self.wait()


class _Sync(Copies):
    def __init__(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        _copy_all(dst, src)


class _Thread(Copies):
    def __init__(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, args=(list(dst), list(src)), name="numguard-snapshot", daemon=True
        )
        self._thread.start()

    def _run(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        try:
            with torch.no_grad():
                _copy_all(dst, src)
        except BaseException as err:  # re-raised on the caller's thread by wait()
            self._error = err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise RuntimeError(f"numguard: an asynchronous snapshot copy failed: {self._error}") from self._error


_SIDE: dict[torch.device, Any] = {}  # one side stream per device, reused


class _Stream(Copies):
    def __init__(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], device: torch.device) -> None:
        self._device = device
        side = _SIDE.get(device)
        if side is None:
            side = _SIDE[device] = torch.cuda.Stream(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        side.wait_event(ready)  # the copies see every write queued before this point
        with torch.cuda.stream(side), torch.no_grad():
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
                for t in (d, s):
                    if t.is_cuda:
                        t.record_stream(side)  # kept alive until the side stream is done with it
        self._done: Any = torch.cuda.Event()
        self._done.record(side)
        self._waited = False

    def wait(self) -> None:
        if not self._waited:  # later work on the current stream runs after the copies (no host stall)
            torch.cuda.current_stream(self._device).wait_event(self._done)
            self._waited = True

    def synchronize(self) -> None:
        self.wait()
        self._done.synchronize()


def _copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=s.is_cuda and (d.is_cuda or d.is_pinned()))


def backend_for(tensors: Sequence[torch.Tensor], asynchronous: bool) -> Backend:
    """``"stream"`` when a tensor is on CUDA, else ``"thread"``; ``"sync"`` unless ``asynchronous``."""
    if not asynchronous:
        return "sync"
    return "stream" if any(t.is_cuda for t in tensors) else "thread"


def start(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], backend: Backend = "sync") -> Copies:
    """Start copying ``src[i]`` into ``dst[i]``; nothing may write a source or read a destination before ``wait``.

    Raises:
        ValueError: for lists of different lengths, or the ``"stream"`` backend without a CUDA source.
    """
    if len(dst) != len(src):
        raise ValueError(f"`dst` and `src` must pair up, got {len(dst)} and {len(src)} tensors")
    if backend == "sync" or not src:
        return _Sync(dst, src)
    if backend == "thread":
        return _Thread(dst, src)
    if backend == "stream":
        device = next((t.device for t in src if t.is_cuda), None)
        if device is None:
            raise ValueError("the 'stream' backend copies from CUDA tensors: use 'thread' or 'sync' on the CPU")
        return _Stream(dst, src, device)
    raise ValueError(f"`backend` must be one of ['stream', 'thread', 'sync'], got {backend!r}")


def plan_tree(
    obj: Any, device: torch.device | str | None, pin: bool, into: Any, pairs: tuple[list[Any], list[Any]]
) -> Any:
    """:func:`~.tree.clone_tree` without copying: the tree of destinations; appends ``(dst, src)`` to ``pairs``.

    Non-tensor leaves are deep-copied now; each tensor gets ``into``'s matching tensor (same shape,
    dtype and target device) or a new one (pinned on the host when ``pin``).
    """

    def plan(leaf: Any, prev: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return copy.deepcopy(leaf)
        src = leaf.detach()
        target = torch.device(device) if device is not None else src.device
        if isinstance(prev, torch.Tensor) and (prev.shape, prev.dtype, prev.device) == (src.shape, src.dtype, target):
            dst = prev
        elif target == src.device:
            dst = torch.empty_like(src)
        else:
            dst = torch.empty(src.shape, dtype=src.dtype, device=target, pin_memory=pin and target.type == "cpu")
        pairs[0].append(dst)
        pairs[1].append(src)
        return dst

    return map_tree(plan, obj, into)
