"""The loss of a plain loop, seen at its backward: ``Tensor.backward`` and ``torch.autograd.backward`` wrapped.

A plain loop computes its loss outside the model and calls ``loss.backward()`` itself; the engine wants that loss
before its backward pass (:meth:`StepFlow.before_backward <lightning_numguard.engine.flow.StepFlow.before_backward>`:
the loss's flag, and the op guard switched off). While at least one :func:`~lightning_numguard.doors.plain.guard.
attach` guard is open, both functions are replaced by thin wrappers (the way the op guard wraps its functions,
:mod:`~lightning_numguard.detect.opguard.patch`): a wrapper hands the tensor to every open guard whose step is in
progress on the calling thread, then calls the original. A backward on any other thread, or with no step in
progress, goes straight through. The originals come back when the last guard closes.

torch and the standard library only.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["install", "uninstall"]


class _Listener(Protocol):
    thread: int | None

    def before_backward(self, loss: torch.Tensor) -> None: ...


class _Busy(threading.local):
    def __init__(self) -> None:
        self.busy = False


_busy = _Busy()
_lock = threading.Lock()
_listeners: weakref.WeakSet[Any] = weakref.WeakSet()
_originals: dict[str, Callable[..., Any]] = {}
_wrappers: dict[str, Callable[..., Any]] = {}


def _tell(tensors: Any) -> None:
    if _busy.busy:
        return
    here = threading.get_ident()
    listeners = [s for s in list(_listeners) if s.thread == here]
    if not listeners:
        return
    _busy.busy = True
    try:
        losses = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or [])
        for listener in listeners:
            for loss in losses:
                if isinstance(loss, torch.Tensor):
                    listener.before_backward(loss)
    finally:
        _busy.busy = False


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        _tell(tensors)
        was, _busy.busy = _busy.busy, True  # Tensor.backward calls torch.autograd.backward: told once
        try:
            return original(tensors, *args, **kwargs)
        finally:
            _busy.busy = was

    return backward


def install(listener: _Listener) -> None:
    """Tell ``listener`` of every backward on its step's thread until :func:`uninstall`."""
    with _lock:
        if not _originals:
            _originals["tensor"], _originals["autograd"] = torch.Tensor.backward, torch.autograd.backward
            _wrappers["tensor"], _wrappers["autograd"] = (
                _wrapped(torch.Tensor.backward),
                _wrapped(torch.autograd.backward),
            )
            torch.Tensor.backward = _wrappers["tensor"]  # type: ignore[method-assign]
            torch.autograd.backward = _wrappers["autograd"]
        _listeners.add(listener)


def uninstall(listener: _Listener) -> None:
    """Stop telling ``listener``; the originals come back once no listener is left (idempotent)."""
    with _lock:
        _listeners.discard(listener)
        if _listeners or not _originals:
            return
        tensor, autograd = _originals.pop("tensor"), _originals.pop("autograd")
        if torch.Tensor.backward is _wrappers.pop("tensor"):  # replaced again by someone else since: leave theirs
            torch.Tensor.backward = tensor  # type: ignore[method-assign]
        if torch.autograd.backward is _wrappers.pop("autograd"):
            torch.autograd.backward = autograd
