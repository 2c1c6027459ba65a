"""``attach(model, optimizer)``: the guard on a plain PyTorch loop, which stays as the user wrote it.

The loop's moments come from torch (:mod:`~lightning_numguard.doors.torchstep`): a training forward pass of the model
starts a micro-batch (its inputs are the batch), the loss is seen at ``loss.backward()``
(:mod:`~lightning_numguard.doors.plain.backward`), the step is read and judged at the first ``optimizer.step()``
(a step pre-hook: a skipped step's gradients are dropped, so ``step()`` changes nothing), and carried out when it
returns (a step post-hook: rollback, quarantine, halt).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lightning_numguard.config.arguments import GuardConfig
from lightning_numguard.config.doc import args_section
from lightning_numguard.doors.plain import backward
from lightning_numguard.doors.plain.loop import PlainLoop
from lightning_numguard.doors.torchstep import TorchStep, inner_module
from lightning_numguard.engine.flow import StepFlow
from lightning_numguard.engine.guard import GuardState
from lightning_numguard.errors import NumGuardConfigError

__all__ = ["AttachedGuard", "attach"]

log = logging.getLogger(__name__)

_DOOR = "attach()"


def attach(
    models: nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module],
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    /,
    **args: Any,
) -> AttachedGuard:
    """Guard a plain PyTorch training loop: two lines, and the loop stays as it is.

    ``models``: the model the loop calls (``model(x)``; compiled, DDP-wrapped or not), or several (a list, or a
    dict of names; the first one's forward pass starts a micro-batch, the others' run within it). ``optimizers``:
    the optimizer that steps them, or several. ``args``: the guard's arguments, those of ``NumGuardCallback``
    (``action``, ``dirpath``, ``check``, ...; see :class:`AttachedGuard`).

    Returns the guard: ``.events``, ``.counters``, ``.close()`` (also a context manager).

    Raises:
        NumGuardConfigError: a model that is not an ``nn.Module``, an optimizer that is not a torch optimizer or
            that holds parameters of no attached model, a model or optimizer another open guard has, or an invalid
            argument.

    Example::

        from lightning_numguard import attach

        guard = attach(model, optimizer, action="rollback")
        for x, y in loader:
            out = model(x)
            loss = loss_fn(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        guard.close()
    """
    guard = AttachedGuard(**args)
    return guard.attach_to(models, optimizers)


class AttachedGuard(GuardConfig, GuardState):
    """The guard of a plain PyTorch loop, as :func:`attach` returns it (see there; built by it, not by hand).

        Each step it checks the batch (the model's forward inputs, by parameter name: ``batch['x']``), every watched
        block's output, the inputs of ops that would device-assert (``binary_cross_entropy``, ``cross_entropy``,
        ``embedding``, ...: refused and named before they run), the loss, the gradients and the parameters, with
        device-side reductions and one host read at the first ``optimizer.step()`` of the step; then it skips, rolls
        back (weights, optimizer state, RNG; the loop's own learning rates stay the loop's), retries, quarantines or
        halts (``NonFiniteError`` out of ``optimizer.step()``, after ``last_finite.ckpt`` is written). Events go to
        ``.events`` and ``<dirpath>/events.jsonl`` (``dirpath``: default ``./numguard``).

        Under ``torch.distributed`` (initialised by the user, the model DDP-wrapped) every rank attaches its own guard;
        the step's flags go through one all-reduce, every rank takes the same decision, and rank 0 writes the files.

        ``last_finite.ckpt``: ``torch.save`` of ``{"model": state_dict, "optimizers": [...], "numguard": guard state}``.

    {args}
        Raises:
            NonFiniteError: out of ``optimizer.step()``, when the guard halts (after the last finite state was
                restored and saved); at the first training step when the weights are already non-finite.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self._flow = StepFlow(self.config)
        self._step: TorchStep | None = None

    def attach_to(
        self,
        models: nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module],
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    ) -> AttachedGuard:
        """Hook ``models`` and ``optimizers`` (what :func:`attach` does with a new guard); returns the guard.

        Raises:
            NumGuardConfigError: as :func:`attach`, and when this guard is attached already.
        """
        if self._step is not None:
            raise NumGuardConfigError("NumGuard: this guard is attached already; attach() a new one for another loop.")
        models, optimizers = _models(models), _optimizers(optimizers)
        tops = list(models.values())
        if len(tops) == 1:
            module = inner_module(tops[0])
        else:
            module = nn.ModuleDict({name: inner_module(m) for name, m in models.items()})
        dirpath = Path(self.dirpath) if self.dirpath else Path.cwd() / "numguard"
        flow = self._flow.setup(module, self.config, dirpath)
        step = TorchStep(flow, PlainLoop(module, tops, self.state_dict), _DOOR, True, _NO_OPTIMIZER)
        try:
            step.attach()
            step.watch(optimizers)
        except BaseException:
            step.detach()
            raise
        self._flow, self._step = flow, step
        backward.install(step)
        step.on_detach.append(lambda: backward.uninstall(step))  # a halt ends the guard too
        return self

    # ------------------------------------------------------------------ the handle

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or a halt ended the guard)."""
        return self._step is None or self._step.finished

    def close(self, exception: BaseException | None = None) -> None:
        """End the guard (idempotent): the last step's update is checked, the summary logged, every hook removed.

        ``exception``: what ended the loop, if it did not end well (the last update is then left unchecked)."""
        if self._step is not None:
            self._step.finish(exception)

    def __enter__(self) -> AttachedGuard:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exception: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close(exception)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"AttachedGuard(action={self.action!r}, {state}, events={len(self.events)})"


AttachedGuard.__doc__ = (AttachedGuard.__doc__ or "").replace("{args}", args_section(GuardConfig))

_NO_OPTIMIZER = (
    "attach() saw the model's first training forward pass but holds no optimizer: pass the optimizer(s) that step "
    "the model, attach(model, optimizer)."
)


def _models(models: Any) -> dict[str, nn.Module]:
    """The attached models by name (one model: ``"model"``; a list: ``"0"``, ``"1"``, ...)."""
    if isinstance(models, nn.Module):
        return {"model": models}
    if isinstance(models, Mapping):
        found = {str(k): v for k, v in models.items()}
    elif isinstance(models, (list, tuple)):
        found = {str(i): v for i, v in enumerate(models)}
    else:
        raise NumGuardConfigError(
            f"NumGuard: attach() got {type(models).__name__!r} where the model was expected: a torch.nn.Module, or "
            "a list or dict of them (attach(model, optimizer))."
        )
    bad = [f"{k!r} ({type(v).__name__})" for k, v in found.items() if not isinstance(v, nn.Module)]
    if bad or not found:
        raise NumGuardConfigError(
            f"NumGuard: attach() got {', '.join(bad) or 'no model'} where models were expected: each a "
            "torch.nn.Module (attach(model, optimizer))."
        )
    return found


def _optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    items = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
    if not isinstance(items, (list, tuple)) or not items:
        raise NumGuardConfigError(
            f"NumGuard: attach() got {type(optimizers).__name__!r} where the optimizer was expected: a "
            "torch.optim.Optimizer, or a list of them (attach(model, optimizer))."
        )
    bad = [type(o).__name__ for o in items if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise NumGuardConfigError(
            f"NumGuard: attach() got {', '.join(map(repr, bad))} where optimizers were expected: each a "
            "torch.optim.Optimizer (attach(model, optimizer))."
        )
    return list(items)
