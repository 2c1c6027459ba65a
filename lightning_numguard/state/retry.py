"""``retry_transient``: re-run a bad batch once from the restored state, only to *decide* transient or persistent.

The retry never trains: it runs ``training_step`` and its backward as the step did (under the precision
plugin's context, so autocast is on and a fault that happens only in fp16 or bf16 happens again), with every
optimizer step and logged value neutralised, then the caller restores the snapshot. Stepping an optimizer here
would bypass gradient clipping, the GradScaler and Lightning's optimizer hooks, and under manual optimization
move Lightning's step counter.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_numguard.detect import checks
from lightning_numguard.diagnose.replay import loss_of
from lightning_numguard.doors.trainer.strategies import holds_local_shards
from lightning_numguard.state.snapshot import set_rng_state

__all__ = ["is_transient"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _neutralised(pl_module: pl.LightningModule, losses: list[torch.Tensor]) -> Iterator[None]:
    """``self.log``, ``manual_backward`` and every ``LightningOptimizer.step`` made inert for the retry.

    ``manual_backward`` becomes a plain ``backward`` of the unscaled loss (kept in ``losses``); ``opt.step``
    only runs its closure, if any. Instance attributes are set and removed again, nothing global is touched.
    """

    def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        losses.append(loss.detach())
        loss.backward(*args, **kwargs)

    def step(closure: Any = None, **kwargs: Any) -> Any:
        return closure() if callable(closure) else None

    optimizers: list[Any] = []
    if not pl_module.automatic_optimization:
        found = pl_module.optimizers(use_pl_optimizer=True)
        optimizers = list(found) if isinstance(found, (list, tuple)) else [found]
    patched = [(pl_module, "log"), (pl_module, "log_dict"), (pl_module, "manual_backward")]
    patched += [(opt, "step") for opt in optimizers]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name in patched]
    pl_module.log = lambda *a, **k: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    pl_module.manual_backward = backward  # type: ignore[method-assign]
    for opt in optimizers:
        opt.step = step
    try:
        yield
    finally:
        for obj, name, value in saved:
            if value is None:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value


def is_transient(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, rng: dict[str, Any] | None
) -> bool:
    """Whether ``batch`` comes out finite when run again from the current (restored) state, on this rank.

    Runs ``training_step`` and the backward of its loss (automatic optimization) or its ``manual_backward``
    calls (manual optimization) under ``trainer.precision_plugin.train_step_context()``, with gradients not
    synchronised across ranks; finite means every loss and every gradient is finite. Steps no optimizer and
    moves no counter; leaves gradients set to ``None``. Syncs (after a hit only).
    """
    if rng is not None:
        set_rng_state(rng)
    pl_module.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    no_sync = getattr(trainer.strategy.model, "no_sync", None)
    collective = trainer.world_size > 1 and holds_local_shards(trainer.strategy)
    ok = True
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(no_sync() if callable(no_sync) else contextlib.nullcontext())
            stack.enter_context(_neutralised(pl_module, losses))
            stack.enter_context(torch.enable_grad())
            with trainer.precision_plugin.train_step_context():  # autocast, as Lightning runs the step
                output = pl_module.training_step(batch, batch_idx)
            loss = loss_of(output) if pl_module.automatic_optimization else None
            if loss is not None:
                losses.append(loss.detach())
                # under collective passes (FSDP2's reduce-scatters) every rank runs the backward, or one would wait
                if loss.requires_grad and (collective or bool(torch.isfinite(loss.detach()).all())):
                    loss.backward()
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        ok = not any(checks.confirm_nonfinite(losses + grads))
        if pl_module.automatic_optimization and not losses:
            ok = False  # the batch gave no loss this time: nothing shows it finite
    except Exception:  # the retry is a judgement: an error in it makes the batch persistent, never fails the run
        log.debug("numguard retry raised", exc_info=True)
        ok = False
    finally:
        pl_module.zero_grad(set_to_none=True)
    return ok
