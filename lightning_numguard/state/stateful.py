"""Adapters that give a snapshot everything a run trains with besides the module and optimizers.

Each adapter has ``state_dict()`` and ``load_state_dict(state)`` (the :class:`Stateful` protocol of
:mod:`~lightning_numguard.state.snapshot`): a torchmetrics metric's accumulated state, numpy's
global RNG, the precision plugin's GradScaler, and what another part of the loop holds (:class:`HeldState`: the
averaged model of a weight-averaging callback, a callback's own state). LR schedulers already are stateful.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_numguard import _compat
from lightning_numguard.state.snapshot import Stateful, clone_tree

__all__ = [
    "HeldState",
    "MetricState",
    "NumpyRNG",
    "PrecisionState",
    "apply_lr_backoff",
    "clone_states",
    "module_states",
]


class MetricState:
    """The accumulated state of a torchmetrics ``Metric`` (not part of its ``state_dict`` by default)."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric

    def state_dict(self) -> dict[str, Any]:
        update_count, computed = _compat.metric_counters(self.metric)
        return {"states": _compat.metric_state(self.metric), "update_count": update_count, "computed": computed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state["states"].items():
            setattr(self.metric, name, value)
        _compat.set_metric_counters(self.metric, state["update_count"], state["computed"])


class NumpyRNG:
    """numpy's global RNG state."""

    def state_dict(self) -> Any:
        import numpy as np

        return np.random.get_state()

    def load_state_dict(self, state: Any) -> None:
        import numpy as np

        np.random.set_state(state)


class PrecisionState:
    """A precision plugin's state (the AMP GradScaler's scale and growth tracker)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def state_dict(self) -> dict[str, Any]:
        """The scaler's scale and growth tracker as tensors (the snapshot copies them: no host sync).

        ``GradScaler.state_dict()`` reads both with ``.item()``; it is used only before the first
        ``scale()`` (no tensors yet, nothing to sync) or when the private names are gone.
        """
        scale, tracker = _compat.scaler_tensors(getattr(self.plugin, "scaler", None))
        if isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor):
            return {"scale_tensor": scale, "growth_tracker_tensor": tracker}
        return dict(self.plugin.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scale_tensor" in state:
            scale, tracker = _compat.scaler_tensors(self.plugin.scaler)
            assert isinstance(scale, torch.Tensor)
            assert isinstance(tracker, torch.Tensor)
            scale.copy_(state["scale_tensor"])
            tracker.copy_(state["growth_tracker_tensor"])
            return
        self.plugin.load_state_dict(state)


class HeldState:
    """What another part of the loop holds that a rollback puts back with the weights: modules (a weight average, a
    callback's own copy of the model), restored in place through their ``state_dict``, and a state of its own
    (``get`` returns it, plain values and tensors, which the snapshot copies; ``put`` puts a copy back).

    Args:
        modules: the modules, by a name of their own.
        get: the held state besides the modules (``None``: none).
        put: puts back what ``get`` returned.
    """

    def __init__(
        self,
        modules: Mapping[str, torch.nn.Module],
        get: Callable[[], Any] | None = None,
        put: Callable[[Any], Any] | None = None,
    ) -> None:
        self.modules = dict(modules)
        self.get, self.put = get, put

    def state_dict(self) -> dict[str, Any]:
        own = self.get() if self.get is not None else None
        return {"modules": {name: m.state_dict() for name, m in self.modules.items()}, "own": own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, module in self.modules.items():
            if name in state["modules"]:
                module.load_state_dict(state["modules"][name])
        if self.put is not None and state.get("own") is not None:
            self.put(state["own"])


def module_states(module: torch.nn.Module) -> dict[str, Stateful]:
    """What a rollback restores that lives in ``module`` but not in its ``state_dict``, for every door: each
    torchmetrics ``Metric``'s accumulated state (``metric:<name>``) and numpy's global RNG (``numpy_rng``)."""
    out: dict[str, Stateful] = {}
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        Metric = ()  # type: ignore[assignment,misc]
    for name, sub in module.named_modules():
        if isinstance(sub, Metric):
            out[f"metric:{name}"] = MetricState(sub)
    out["numpy_rng"] = NumpyRNG()
    return out


def clone_states(stateful: Mapping[str, Stateful], names: Sequence[str]) -> dict[str, Any]:
    """Device-side copies of the states named ``names`` (the start-of-step states)."""
    return {n: clone_tree(stateful[n].state_dict()) for n in names if n in stateful}


_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def apply_lr_backoff(
    optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any], factor: float
) -> list[float]:
    """Multiply every learning rate by ``factor``: param groups and the schedulers' base rates.

    Schedulers that compute the rate from ``base_lrs`` (LambdaLR, OneCycleLR, cosine…) would
    otherwise undo a change to the param groups at their next step. Returns the new rates.
    """
    for opt in optimizers:
        for group in opt.param_groups:
            for key in _LR_KEYS:
                value = group.get(key)
                if isinstance(value, torch.Tensor):
                    value.mul_(factor)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    group[key] = value * factor
    for scheduler in schedulers:
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        _compat.sync_scheduler_last_lr(scheduler)
    return [g["lr"] for opt in optimizers for g in opt.param_groups]
