"""Which trainable parameters an optimizer covers, and which it should not."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["CoverageReport", "check_coverage", "never_got_grad"]


@dataclass(frozen=True)
class CoverageReport:
    """Problems found in the optimizers' coverage of a model's parameters (names, not tensors)."""

    not_in_optimizer: list[str] = field(default_factory=list)
    frozen_in_optimizer: list[str] = field(default_factory=list)
    in_several_groups: list[str] = field(default_factory=list)

    def problems(self) -> list[tuple[str, list[str], str]]:
        """``(problem, names, hint)`` for each non-empty finding."""
        out = []
        if self.frozen_in_optimizer:
            out.append(
                (
                    "frozen parameters (requires_grad=False) handed to an optimizer",
                    self.frozen_in_optimizer,
                    "build the optimizer from trainable parameters only, e.g. "
                    "`Adam(p for p in model.parameters() if p.requires_grad)`; weight decay or a later "
                    "unfreeze would otherwise move layers meant to stay fixed",
                )
            )
        if self.not_in_optimizer:
            out.append(
                (
                    "trainable parameters in no optimizer",
                    self.not_in_optimizer,
                    "add them to an optimizer's param groups, or set `requires_grad_(False)` if they are "
                    "meant to stay fixed",
                )
            )
        if self.in_several_groups:
            out.append(
                (
                    "parameters in more than one param group or optimizer",
                    self.in_several_groups,
                    "each parameter must appear once: it is otherwise updated twice per step",
                )
            )
        return out


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}


def check_coverage(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> CoverageReport:
    """Compare ``model``'s parameters with every param group of ``optimizers``."""
    names = _names(model)
    seen: dict[int, int] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                seen[id(p)] = seen.get(id(p), 0) + 1
    params = {id(p): p for p in model.parameters()}
    return CoverageReport(
        not_in_optimizer=[names[i] for i, p in params.items() if p.requires_grad and i not in seen],
        frozen_in_optimizer=[names[i] for i, p in params.items() if not p.requires_grad and i in seen],
        in_several_groups=[names[i] for i in params if seen.get(i, 0) > 1],
    )


def never_got_grad(model: nn.Module, params: Iterable[torch.Tensor]) -> list[str]:
    """Names of trainable ``params`` whose ``.grad`` is ``None`` (call just before an optimizer step)."""
    names = _names(model)
    return [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params if p.requires_grad and p.grad is None]
