"""``NumGuard``: the guard as a Lightning Fabric callback, needing nothing from the loop but what Fabric calls.

Fabric calls two hooks on its callbacks by itself: ``on_after_setup(fabric, module)`` from ``fabric.setup`` and
``on_after_optimizer_step(strategy, optimizer)`` after each ``optimizer.step()``. From the first, the guard hooks
the rest of the step (:mod:`~lightning_numguard.doors.torchstep`) and three of the Fabric's own methods, on that
instance only, until the fit ends:

==================================  ====================================================================
``fabric.setup_optimizers``         the optimizers it sets up are guarded (those passed to
                                    ``fabric.setup(model, optimizer)`` are found there)
``fabric.no_backward_sync``         whether the micro-batch accumulates (its step comes later)
``fabric.backward``                 the loss before its backward; after it, when the micro-batch does not
                                    accumulate: the step's one read and its judgement, so that nothing the
                                    loop does next (``clip_gradients(error_if_nonfinite=True)``, the
                                    optimizer) reads a gradient of a skipped step (they are dropped)
``on_after_optimizer_step``         the step is over: skip, rollback, quarantine or halt carried out
==================================  ====================================================================

The optimizer's step pre-hook takes the decision when no ``fabric.backward`` came before (a loop calling
``loss.backward()`` itself).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_numguard import _compat
from lightning_numguard.config.arguments import GuardConfig
from lightning_numguard.config.doc import args_section
from lightning_numguard.doors.fabric.loop import FabricLoop, files_folder
from lightning_numguard.doors.torchstep import TorchStep, inner_module
from lightning_numguard.engine.flow import StepFlow
from lightning_numguard.engine.guard import GuardState
from lightning_numguard.errors import NumGuardConfigError

__all__ = ["NumGuard"]

log = logging.getLogger(__name__)

_DOC = r"""Guard a Lightning Fabric training loop against NaN/Inf: ``Fabric(callbacks=[NumGuard()])``, nothing else.

    It needs no ``fabric.call`` from the loop: it learns the model at ``fabric.setup`` and the optimizers there or at
    ``fabric.setup_optimizers``; it sees the model's forward inputs (the batch, by parameter name:
    ``batch['idx']``), every watched block's output, the inputs of ops that would device-assert (also an
    ``nn.Embedding`` inside a ``torch.compile``d model: a token id past the vocabulary is refused before the
    embedding runs), the loss at ``fabric.backward`` and the gradients; it reads and decides right after
    ``fabric.backward`` (so ``fabric.clip_gradients``, whose ``error_if_nonfinite`` defaults to ``True``, never
    sees a gradient of a step it skips), and carries the decision out after ``optimizer.step()``: skip, rollback
    (weights, optimizer state, RNG; the learning rates the loop sets stay the loop's), retry, quarantine, halt.
    Under gradient accumulation (``fabric.no_backward_sync(model, enabled=...)``) it counts one step per optimizer
    step and names the bad micro-batch.

    Files go to ``dirpath``, else to ``<log_dir>/numguard`` of Fabric's logger, else to ``./numguard``. With
    ``NUMGUARD=1`` (or ``NUMGUARD_CONFIG=numguard.yaml``) in the environment every ``Fabric`` gets one, from
    Fabric's callback entry points: ``NUMGUARD=1 litgpt pretrain ...`` is guarded with no change to LitGPT.

{args}
    ``sync_mode="deferred"`` does not apply to a Fabric loop (its ``clip_gradients`` raises on the gradients
    that the device-side skip would leave in place): it raises ``NumGuardConfigError``.

    Raises:
        NumGuardConfigError: at construction, for an invalid argument; at ``optimizer.step()`` when
            ``on_after_setup`` never ran (``fabric.setup_module`` calls no callback); at the first training
            forward pass when no optimizer was set up with Fabric.
        NonFiniteError: out of ``optimizer.step()`` when the guard halts, on every rank, after the last finite state
            was restored and saved (``fabric.save``: load it with ``fabric.load``); at the first training forward
            pass when the weights are already non-finite.

    Logged: the ``numguard/...`` scalars and the ``numguard/events`` text of ``NumGuardCallback`` on Fabric's
    loggers (TensorBoard's text and picture through Fabric's ``TensorBoardLogger``), every 50 steps and at each
    event. Across ranks (DDP): one packed all-reduce per step, every rank acts together, rank 0 writes the files.

    Example::

        from lightning.fabric import Fabric
        from lightning_numguard.fabric import NumGuard

        fabric = Fabric(callbacks=[NumGuard(action="rollback")])
        model, optimizer = fabric.setup(model, optimizer)
    """


class NumGuard(GuardConfig, GuardState):
    __doc__ = _DOC.replace("{args}", args_section(GuardConfig))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sync_mode == "deferred":
            raise NumGuardConfigError(
                "NumGuard: `sync_mode='deferred'` does not apply to a Fabric loop: its `fabric.clip_gradients` "
                "(error_if_nonfinite=True by default) raises on the gradients the device-side skip leaves in place; "
                "use sync_mode='every_step' (the default)."
            )
        self._flow = StepFlow(self.config)
        self._step: TorchStep | None = None
        self._undo: list[tuple[Any, str]] = []  # the Fabric methods wrapped on the instance
        at_exit = weakref.WeakMethod(self._at_exit)
        atexit.register(lambda: (close := at_exit()) is not None and close())

    # ------------------------------------------------------------------ Fabric's hooks

    def on_after_setup(self, fabric: Any, module: nn.Module) -> None:
        """``fabric.setup(module, ...)`` ran: hook the step (before any compiled call) and learn the optimizers."""
        step = self._step
        if step is not None and not step.finished:
            if module in step.loop.tops:
                return
            if step.started or getattr(step.loop, "fabric", None) is fabric:
                name = type(inner_module(module)).__name__
                log.info("numguard guards the first model set up with this Fabric; this %s is not guarded", name)
                return
        if step is not None:
            self.close()
        inner = inner_module(module)
        loop = FabricLoop(fabric, inner, module, self.state_dict, fabric.no_backward_sync)
        flow = self._flow.setup(inner, self.config, files_folder(fabric, self.dirpath))
        step = TorchStep(flow, loop, "NumGuard", False, _NO_OPTIMIZER)
        step.attach()
        self._flow, self._step = flow, step
        self._wrap(fabric, step)
        step.on_detach.append(self._unwrap)  # a halt ends the fit too
        found = _compat.fabric_setup_optimizers(fabric, inner) or []
        step.watch([_torch_optimizer(o) for o in found])

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        """An optimizer stepped: the step is over."""
        step = self._step
        if step is None:
            raise NumGuardConfigError(
                "NumGuard: Fabric stepped an optimizer, but on_after_setup never ran, so nothing was guarded: set the "
                "model up with `fabric.setup(model, optimizer)` (`fabric.setup_module` calls no callback), or call "
                "`fabric.call('on_after_setup', fabric=fabric, module=model)` after `fabric.setup_module(model)`."
            )
        if step.started and step.decided:
            step.end_step()

    def on_train_end(self) -> None:
        """The loop's own ``fabric.call("on_train_end")``, if it makes one: the fit is over (see :meth:`close`)."""
        self.close()

    # ------------------------------------------------------------------ the fit's end

    def close(self, exception: BaseException | None = None) -> None:
        """End the fit (idempotent): the last step's update checked, the summary logged, every hook and wrapped
        method removed. Called by ``on_train_end``, by a halt, and at the interpreter's exit."""
        step = self._step
        if step is None:
            return
        try:
            step.finish(exception)
        finally:
            self._unwrap()

    def _at_exit(self) -> None:
        """A Fabric loop has no end hook of its own: a fit left open is closed at the interpreter's exit (its summary
        logged); with several processes the last update is left unchecked (the process group may be gone)."""
        step = self._step
        if step is not None and not step.finished:
            with contextlib.suppress(Exception):
                step.finish(check_last=step.loop.world_size == 1)
            self._unwrap()

    # ------------------------------------------------------------------ the Fabric's methods

    def _wrap(self, fabric: Any, step: TorchStep) -> None:
        loop = step.loop
        assert isinstance(loop, FabricLoop)
        setup_optimizers, backward, no_backward_sync = (
            fabric.setup_optimizers,
            fabric.backward,
            fabric.no_backward_sync,
        )

        def guarded_setup_optimizers(*optimizers: Any) -> Any:
            out = setup_optimizers(*optimizers)
            step.watch([_torch_optimizer(o) for o in (out if isinstance(out, tuple) else (out,))])
            return out

        def guarded_backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            step.before_backward(tensor)
            backward(tensor, *args, **kwargs)
            if not loop.in_no_sync:
                step.decide()

        @contextlib.contextmanager
        def guarded_no_backward_sync(module: Any, enabled: bool = True) -> Iterator[None]:
            with no_backward_sync(module, enabled=enabled):
                was, loop.in_no_sync = loop.in_no_sync, bool(enabled)
                try:
                    yield
                finally:
                    loop.in_no_sync = was

        self._unwrap()
        for name, wrapper in (
            ("setup_optimizers", guarded_setup_optimizers),
            ("backward", guarded_backward),
            ("no_backward_sync", guarded_no_backward_sync),
        ):
            setattr(fabric, name, wrapper)
            self._undo.append((fabric, name))

    def _unwrap(self) -> None:
        for fabric, name in self._undo:
            with contextlib.suppress(AttributeError):
                delattr(fabric, name)  # the instance attribute: the class's method shows again
        self._undo = []

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_step"], state["_undo"] = None, []  # the hooks of a running fit stay with it
        return state


_NO_OPTIMIZER = (
    "NumGuard saw the model's first training forward pass but no optimizer: set the optimizer up with Fabric "
    "before training (`model, optimizer = fabric.setup(model, optimizer)`, or `fabric.setup_optimizers(optimizer)`)."
)


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer of a Fabric optimizer wrapper (its public ``optimizer``), else ``optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer
