"""Adapters that let the core snapshot capture everything a Lightning run trains with."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from lightning_numguard.core.snapshot import Stateful, clone_tree

__all__ = ["MetricState", "NumpyRNG", "PrecisionState", "apply_lr_backoff", "stateful_objects"]


class MetricState:
    """The accumulated state of a torchmetrics ``Metric`` (not part of its ``state_dict`` by default)."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric

    def state_dict(self) -> dict[str, Any]:
        m = self.metric
        return {
            "states": {name: getattr(m, name) for name in m._defaults},
            "update_count": m._update_count,
            "computed": m._computed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        m = self.metric
        for name, value in state["states"].items():
            setattr(m, name, value)
        m._update_count = state["update_count"]
        m._computed = state["computed"]


class NumpyRNG:
    """numpy's global RNG state."""

    def state_dict(self) -> Any:
        import numpy as np

        return np.random.get_state()

    def load_state_dict(self, state: Any) -> None:
        import numpy as np

        np.random.set_state(state)


class PrecisionState:
    """The precision plugin's state (the AMP GradScaler's scale and growth tracker)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def state_dict(self) -> dict[str, Any]:
        return dict(self.plugin.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plugin.load_state_dict(state)


def stateful_objects(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Stateful]:
    """Everything besides the module and optimizers that a bitwise rollback must restore."""
    out: dict[str, Stateful] = {}
    for i, config in enumerate(trainer.lr_scheduler_configs):
        out[f"lr_scheduler:{i}"] = config.scheduler
    plugin = trainer.precision_plugin
    if getattr(plugin, "scaler", None) is not None:
        out["precision"] = PrecisionState(plugin)
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency of Lightning
        Metric = None  # type: ignore[assignment,misc]
    if Metric is not None:
        for name, module in pl_module.named_modules():
            if isinstance(module, Metric):
                out[f"metric:{name}"] = MetricState(module)
    try:
        import numpy  # noqa: F401
    except ImportError:  # pragma: no cover
        pass
    else:
        out["numpy_rng"] = NumpyRNG()
    return out


def clone_states(stateful: dict[str, Stateful], names: list[str]) -> dict[str, Any]:
    """Device-side copies of the states named ``names`` (the start-of-step states)."""
    return {n: clone_tree(stateful[n].state_dict()) for n in names if n in stateful}


_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def apply_lr_backoff(trainer: pl.Trainer, factor: float) -> list[float]:
    """Multiply every learning rate by ``factor``: param groups and the schedulers' base rates.

    Schedulers that compute the rate from ``base_lrs`` (LambdaLR, OneCycleLR, cosine…) would
    otherwise undo a change to the param groups at their next step.
    """
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            for key in _LR_KEYS:
                value = group.get(key)
                if isinstance(value, torch.Tensor):
                    value.mul_(factor)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    group[key] = value * factor
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
    return [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]
