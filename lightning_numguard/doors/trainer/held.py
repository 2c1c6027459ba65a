"""What the Trainer's other callbacks hold that a rollback puts back with the weights.

A callback that keeps a copy of the weights after the optimizer step takes in whatever that step made: Lightning's
``WeightAveraging`` (``EMAWeightAveraging``) folds the weights into its average in ``on_train_batch_end`` and
``StochasticWeightAveraging`` at each epoch's start, both before the guard's post-step check (which rides the next
step's read) has seen them. So the snapshots hold their averaged model and counters too (their private names through
:mod:`lightning_numguard._compat`), and a rollback restores them with the rest: the average never keeps what a
rollback removed. Any other callback is restored when ``recovery.restore_callbacks`` names its class: its
``state_dict``/``load_state_dict`` and the ``nn.Module`` held in its public attributes.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence
from typing import Any

import torch

from lightning_numguard import _compat
from lightning_numguard.engine.guard import GuardState
from lightning_numguard.state.stateful import HeldState

__all__ = ["held_states"]

log = logging.getLogger(__name__)

#: Lightning's callbacks that average the weights (by class name: the same in both Lightning packages)
AVERAGING = ("WeightAveraging", "StochasticWeightAveraging")


def held_states(callbacks: Sequence[Any], module: torch.nn.Module, patterns: Sequence[str]) -> dict[str, HeldState]:
    """The state of each callback in ``callbacks`` that a rollback restores, by ``callback:<class name>`` (a second
    callback of the same class gets ``:1``, ...): Lightning's weight averages always, the callbacks whose class name
    matches one of ``patterns`` with their own state and modules. The guard itself is left out."""
    out: dict[str, HeldState] = {}
    for callback in callbacks:
        if isinstance(callback, GuardState):
            continue
        held = _averaging(callback) if _is_averaging(callback) else None
        if held is None and any(fnmatch.fnmatchcase(type(callback).__name__, p) for p in patterns):
            held = _declared(callback, module)
        if held is None:
            continue
        key = f"callback:{type(callback).__name__}"
        n = sum(1 for k in out if k == key or k.startswith(key + ":"))
        out[f"{key}:{n}" if n else key] = held
    return out


def _is_averaging(callback: Any) -> bool:
    return any(cls.__name__ in AVERAGING and "lightning" in cls.__module__ for cls in type(callback).__mro__)


def _averaging(callback: Any) -> HeldState | None:
    """A weight-averaging callback's averaged model, its counters and (SWA) the count of models averaged."""
    average = _compat.averaged_model(callback)
    if average is None:
        log.warning(
            "numguard cannot reach the averaged model of %s in this Lightning version: a rollback does not restore it",
            type(callback).__name__,
        )
        return None

    def get() -> dict[str, Any]:
        count = getattr(callback, "n_averaged", None)  # StochasticWeightAveraging's (public), a tensor once it runs
        return {"counters": _compat.averaging_counters(callback), "n_averaged": count}

    def put(state: dict[str, Any]) -> None:
        _compat.set_averaging_counters(callback, state["counters"])
        live = getattr(callback, "n_averaged", None)
        if isinstance(live, torch.Tensor):  # in place: the callback holds this tensor; none before: nothing averaged
            saved = state["n_averaged"]
            if isinstance(saved, torch.Tensor):
                live.copy_(saved)
            else:
                live.zero_()

    return HeldState({"average": average}, get, put)


def _declared(callback: Any, module: torch.nn.Module) -> HeldState:
    """A callback named by ``recovery.restore_callbacks``: its ``state_dict``/``load_state_dict`` and its modules."""
    modules = {
        name: value
        for name, value in vars(callback).items()
        if not name.startswith("_") and isinstance(value, torch.nn.Module) and value is not module
    }
    has_state = callable(getattr(callback, "state_dict", None)) and callable(getattr(callback, "load_state_dict", None))
    if not has_state:
        return HeldState(modules)
    return HeldState(modules, callback.state_dict, callback.load_state_dict)
