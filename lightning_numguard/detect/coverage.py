"""Which trainable parameters an optimizer covers, and which it should not: problems as codes, no prose."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "COVERAGE_CODES",
    "FROZEN_IN_OPTIMIZER",
    "IN_SEVERAL_GROUPS",
    "NOT_IN_OPTIMIZER",
    "NO_GRAD_IN_FIRST_STEP",
    "CoverageReport",
    "check_coverage",
    "never_got_grad",
]


#: Frozen parameters (``requires_grad=False``) handed to an optimizer.
FROZEN_IN_OPTIMIZER = "frozen_in_optimizer"
#: Trainable parameters that no optimizer holds.
NOT_IN_OPTIMIZER = "not_in_optimizer"
#: Parameters in more than one param group or optimizer.
IN_SEVERAL_GROUPS = "in_several_groups"
#: Trainable parameters that received no gradient in the first step (see :func:`never_got_grad`).
NO_GRAD_IN_FIRST_STEP = "no_grad_in_first_step"
#: Every coverage problem code, in the order problems are reported.
COVERAGE_CODES: tuple[str, ...] = (FROZEN_IN_OPTIMIZER, NOT_IN_OPTIMIZER, IN_SEVERAL_GROUPS, NO_GRAD_IN_FIRST_STEP)


@dataclass(frozen=True)
class CoverageReport:
    """Problems found in the optimizers' coverage of a model's parameters (names, not tensors)."""

    not_in_optimizer: list[str] = field(default_factory=list)
    frozen_in_optimizer: list[str] = field(default_factory=list)
    in_several_groups: list[str] = field(default_factory=list)

    def problems(self) -> list[tuple[str, list[str]]]:
        """``(code, names)`` for each non-empty finding, codes from :data:`COVERAGE_CODES`.

        The words for each code (problem and hint) are in
        :func:`lightning_numguard.reporting.hints.coverage_problem`.
        """
        found = (
            (FROZEN_IN_OPTIMIZER, self.frozen_in_optimizer),
            (NOT_IN_OPTIMIZER, self.not_in_optimizer),
            (IN_SEVERAL_GROUPS, self.in_several_groups),
        )
        return [(code, names) for code, names in found if names]


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
