"""``recovery.retry_transient``: re-run a bad batch once from the restored state, only to *decide* transient or
persistent.

The retry never trains: it runs the step's forward pass and its backward as the step did, through the loop's
quiet re-run (:meth:`Loop.rerun <lightning_numguard.engine.loop.Loop.rerun>`: under the loop's autocast, so a fault
that happens only in fp16 or bf16 happens again, with every optimizer step and logged value neutralised), then the
caller restores the snapshot. Stepping an optimizer here would bypass gradient clipping, the GradScaler and the
loop's own optimizer hooks, and under manual optimization move Lightning's step counter.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lightning_numguard.detect import checks
from lightning_numguard.diagnose.replay import loss_of
from lightning_numguard.engine.loop import Loop
from lightning_numguard.state.rng import set_rng_state

__all__ = ["is_transient"]

log = logging.getLogger(__name__)


def is_transient(loop: Loop, batch: Any, batch_idx: int, rng: dict[str, Any] | None) -> bool:
    """Whether ``batch`` comes out finite when run again from the current (restored) state, on this rank.

    Runs the micro-batch again and the backward of its loss, with gradients not synchronised across ranks;
    finite means the loss and every gradient are finite. Steps no optimizer and moves no counter; leaves
    gradients set to ``None``. Syncs (after a hit only).
    """
    if rng is not None:
        set_rng_state(rng)
    module = loop.module
    module.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    ok = True
    try:
        with loop.no_sync(), torch.enable_grad():
            with loop.rerun(batch, batch_idx) as run_step:
                loss = loss_of(run_step())
            if loss is not None:
                losses.append(loss.detach())
                # under collective passes (FSDP2's reduce-scatters) every rank runs the backward, or one would wait
                if loss.requires_grad and (loop.local_shards or bool(torch.isfinite(loss.detach()).all())):
                    loss.backward()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        ok = not any(checks.confirm_nonfinite(losses + grads))
        if loop.automatic and not losses:
            ok = False  # the batch gave no loss this time: nothing shows it finite
    except Exception:  # the retry is a judgement: an error in it makes the batch persistent, never fails the run
        log.debug("numguard retry raised", exc_info=True)
        ok = False
    finally:
        module.zero_grad(set_to_none=True)
    return ok
