"""Lightning glue for the replay: re-run ``training_step`` on a bad batch, quietly, on this rank only.

The search itself (first forward op, or autograd node) is :func:`lightning_numguard.diagnose.replay.replay`.
The replay must change nothing of the run: ``self.log`` goes nowhere, no optimizer steps (under manual
optimization ``training_step`` calls ``opt.step()`` itself: each step runs its closure only, so neither
the weights nor Lightning's step counters move), ``manual_backward`` calls no hooks, and the step runs
under the precision plugin's autocast, so that a bf16/fp16-only NaN reproduces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_numguard.diagnose.replay import replay
from lightning_numguard.doors.trainer.strategies import holds_local_shards
from lightning_numguard.engine import group as _distributed

__all__ = ["replay_batch"]


@contextlib.contextmanager
def _patched(obj: Any, **attrs: Any) -> Iterator[None]:
    """Set instance attributes of ``obj`` for the duration, then put back exactly what was there."""
    saved = {name: obj.__dict__.get(name, _MISSING) for name in attrs}
    obj.__dict__.update(attrs)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value


_MISSING = object()


def _closure_only(closure: Any = None, **kwargs: Any) -> Any:
    """An optimizer ``step`` that runs its closure (forward and backward) and changes nothing."""
    return closure() if callable(closure) else None


def _optimizers(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
    found: list[Any] = list(trainer.optimizers)
    try:
        wrapped = pl_module.optimizers(use_pl_optimizer=True)
    except Exception:  # no trainer attached, or no optimizers
        wrapped = []
    found.extend(wrapped if isinstance(wrapped, list) else [wrapped])
    return [o for o in found if hasattr(o, "__dict__")]


def replay_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, rng: dict[str, Any] | None
) -> dict[str, Any]:
    """Replay ``batch`` from the current weights; see :func:`~lightning_numguard.diagnose.replay.replay`.

    Gradients are not synchronised across ranks (``no_sync``): only this rank replays. Under a strategy whose
    forward and backward are collective (``ModelParallelStrategy``: FSDP2's all-gathers and reduce-scatters,
    tensor parallelism's all-reduces) every rank replays together (every rank calls this after the same
    all-reduced flags) and the ranks agree on each further pass.
    """
    losses: list[torch.Tensor] = []

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        losses.append(loss)  # the replay runs the backward itself, from every loss handed here

    def run_step() -> Any:
        losses.clear()
        out = pl_module.training_step(batch, batch_idx)
        if out is None and losses:
            graph = [x.sum() for x in losses if x.requires_grad]
            return torch.stack(graph).sum() if graph else None
        return out

    no_sync = getattr(trainer.strategy.model, "no_sync", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(no_sync() if callable(no_sync) else contextlib.nullcontext())
        stack.enter_context(_patched(pl_module, log=_ignore, log_dict=_ignore, manual_backward=manual_backward))
        for opt in _optimizers(trainer, pl_module):
            stack.enter_context(_patched(opt, step=_closure_only))
        stack.enter_context(trainer.precision_plugin.train_step_context())
        stack.enter_context(_eager())
        return replay(pl_module, run_step, rng, sites=True, agree=_agreement(trainer), batch=batch)


def _agreement(trainer: pl.Trainer) -> Callable[[bool], bool] | None:
    """Under a strategy whose passes are collective, "does any rank want the next pass?" (collective)."""
    if trainer.world_size <= 1 or not holds_local_shards(trainer.strategy):
        return None
    return lambda wish: bool(_distributed.any_rank(trainer, ["pass"] if wish else []))


def _eager() -> contextlib.AbstractContextManager[Any]:
    """``torch.compile``d modules run their Python forward during the replay (torch >= 2.6), so that the op
    search sees inside a compiled region; on older torch the compiled module is named as a whole."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if callable(set_stance) else contextlib.nullcontext()


def _ignore(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during a replay: the replayed values stay out of the run's metrics."""
