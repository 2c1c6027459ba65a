"""Interception of the guarded functions only: an op the guard does not guard costs nothing.

While at least one :class:`~lightning_numguard.detect.opguard.OpGuard` is entered, each function of
its table is replaced, in every namespace that holds it (``torch``, ``torch.nn.functional``,
``torch.Tensor``, ``torch._C._nn``), by a thin wrapper; when the last guard exits, the originals
are put back. Unguarded ops are not touched at all (a ``TorchFunctionMode`` costs every op of the
forward about a microsecond).

The wrapper is safe to leave installed:

* **threads**: the guards are kept per thread; on a thread with no guard entered (a data loader's
  pin-memory thread, another model) the wrapper calls the original at once;
* **re-entrancy**: while a guarded call runs (its check and its original function), the guarded
  functions it calls itself pass straight through, so ``F.cross_entropy`` is checked once and the
  ``torch._C._nn.cross_entropy_loss`` it calls is not checked again; a reference to
  ``F.cross_entropy`` taken before the guard was entered still reaches the raw binding, which is
  guarded;
* **errors**: the busy mark is cleared in ``finally``; install and removal hold a lock and count
  users per function, so nested and concurrent guards restore exactly what they replaced.

Replacing a ``torch.Tensor`` method changes the class, which costs every later tensor attribute
lookup a cache miss (a few hundred microseconds over a forward pass); a guard entered once per step
should therefore be *held* (:meth:`OpGuard.hold`) for the whole run, so that entering and leaving
it only push and pop this thread's guard stack.

torch and the standard library only.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from lightning_numguard._compat import nn_bindings

__all__ = ["acquire", "active_guards", "install", "release", "uninstall"]


class _Guard(Protocol):
    enabled: bool
    forms: dict[Callable[..., Any], Any]

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class _Local(threading.local):
    def __init__(self) -> None:
        self.guards: list[_Guard] = []
        self.busy = False


_local = _Local()
_lock = threading.Lock()
#: id(original) -> [original, wrapper, users, [(namespace, name, had_own_attribute)]]
_installed: dict[int, list[Any]] = {}
#: id(original) -> (original, wrapper, places): built once per function, reused by every install
_made: dict[int, tuple[Callable[..., Any], Callable[..., Any], list[tuple[object, str, bool]]]] = {}


def active_guards() -> list[_Guard]:
    """The guards entered on this thread, innermost last."""
    return _local.guards


def _namespaces() -> list[object]:
    raw = nn_bindings()
    return [F, torch, torch.Tensor] + ([raw] if raw is not None else [])


def _locations(func: Callable[..., Any]) -> list[tuple[object, str, bool]]:
    """Every ``(namespace, name)`` whose attribute is ``func`` itself."""
    name = getattr(func, "__name__", None)
    if not name:
        return []
    out = []
    for ns in _namespaces():
        if getattr(ns, name, None) is func:
            own = name in vars(ns) if isinstance(ns, type) else True
            out.append((ns, name, own))
    return out


def _wrap(func: Callable[..., Any]) -> Callable[..., Any]:
    local = _local

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        guards = local.guards
        if guards and not local.busy:
            for guard in reversed(guards):  # the innermost enabled guard that guards this function
                if guard.enabled and func in guard.forms:
                    local.busy = True
                    try:
                        return guard.call(func, args, kwargs)
                    finally:
                        local.busy = False
        return func(*args, **kwargs)

    return guarded


def acquire(funcs: Iterable[Callable[..., Any]]) -> None:
    """Make sure each of ``funcs`` is intercepted (counted: :func:`release` undoes one call)."""
    with _lock:
        for func in funcs:
            entry = _installed.get(id(func))
            if entry is None:
                made = _made.get(id(func))
                if made is None:
                    made = _made[id(func)] = (func, _wrap(func), _locations(func))
                _, wrapper, places = made
                for ns, name, _ in places:
                    setattr(ns, name, wrapper)
                entry = _installed[id(func)] = [func, wrapper, 0, places]
            entry[2] += 1


def release(funcs: Iterable[Callable[..., Any]]) -> None:
    """Undo one :func:`acquire`: put back each of ``funcs`` nothing else holds."""
    with _lock:
        for func in funcs:
            entry = _installed.get(id(func))
            if entry is None:
                continue
            entry[2] -= 1
            if entry[2] > 0:
                continue
            del _installed[id(func)]
            for ns, name, own in entry[3]:
                if getattr(ns, name, None) is not entry[1]:
                    continue  # replaced again by someone else since: leave theirs
                if own:
                    setattr(ns, name, func)
                else:
                    delattr(ns, name)


def install(guard: _Guard, funcs: Iterable[Callable[..., Any]]) -> None:
    """Enter ``guard`` on this thread and make sure each of ``funcs`` is intercepted."""
    acquire(funcs)
    _local.guards.append(guard)


def uninstall(guard: _Guard, funcs: Iterable[Callable[..., Any]]) -> None:
    """Leave ``guard`` on this thread; put back each of ``funcs`` nothing else holds."""
    guards = _local.guards
    if guards and guards[-1] is guard:  # the usual: the innermost guard leaves (a held guard: every step)
        guards.pop()
    else:
        for i in range(len(guards) - 1, -1, -1):
            if guards[i] is guard:
                del guards[i]
                break
    if funcs:  # a held guard leaves its functions wrapped: nothing to put back
        release(funcs)
