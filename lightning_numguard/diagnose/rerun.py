"""The replay's re-run of a bad micro-batch: quietly, on this rank only, eagerly inside compiled regions.

The search itself (first forward op, or autograd node) is :func:`lightning_numguard.diagnose.replay.replay`; how a
micro-batch is run again is the loop's (:meth:`Loop.rerun <lightning_numguard.engine.loop.Loop.rerun>`: nothing
logged, no optimizer stepped, no counter moved, under the loop's autocast so that a bf16/fp16-only NaN
reproduces). The replay must change nothing of the run; the caller restores the state afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from lightning_numguard.diagnose.replay import Replay, replay
from lightning_numguard.engine import group
from lightning_numguard.engine.loop import Loop

__all__ = ["replay_batch"]


def replay_batch(loop: Loop, batch: Any, batch_idx: int, rng: dict[str, Any] | None) -> Replay:
    """Replay ``batch`` from the current weights; see :func:`~lightning_numguard.diagnose.replay.replay`.

    Gradients are not synchronised across ranks (``no_sync``): only this rank replays. When the forward and
    backward passes are collective (FSDP2's all-gathers and reduce-scatters, tensor parallelism's all-reduces)
    every rank replays together (every rank calls this after the same all-reduced flags) and the ranks agree on
    each further pass.
    """
    with loop.no_sync(), loop.rerun(batch, batch_idx) as run_step, _eager():
        return replay(loop.module, run_step, rng, sites=True, agree=_agreement(loop), batch=batch)


def _agreement(loop: Loop) -> Callable[[bool], bool] | None:
    """When the passes are collective, "does any rank want the next pass?" (collective)."""
    if loop.world_size <= 1 or not loop.local_shards:
        return None
    return lambda wish: bool(group.any_rank(loop, ["pass"] if wish else []))


def _eager() -> contextlib.AbstractContextManager[Any]:
    """``torch.compile``d modules run their Python forward during the replay (torch >= 2.6), so that the op
    search sees inside a compiled region; on older torch the compiled module is named as a whole."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if callable(set_stance) else contextlib.nullcontext()
