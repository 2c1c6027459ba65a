"""Test helpers: the fault models and data of :mod:`instruments.faults` (shared with the benchmarks), and what only
the tests need (warning matchers, a sync window, the spike window of a guard)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import pytorch_lightning as pl

from instruments.faults import (
    QUIET,
    SITE_CULPRIT,
    SITE_WARNING,
    SITES,
    FaultData,
    FaultModel,
    all_finite,
    loader,
    quiet_trainer,
    trainer,
)
from lightning_numguard.errors import NumGuardWarning

__all__ = [
    "EVERY_CHECK",
    "QUIET",
    "SITES",
    "SITE_CULPRIT",
    "SITE_WARNING",
    "FaultData",
    "FaultModel",
    "SyncWindow",
    "all_finite",
    "guard_warning",
    "guard_warns",
    "loader",
    "quiet_trainer",
    "spike_window",
    "trainer",
]

#: Every per-step check, forward hooks on module outputs included (not a default: replay names the module).
EVERY_CHECK = ["inputs", "outputs", "ops", "loss", "grads", "params", "optimizer_state"]


@contextmanager
def guard_warns(pattern: str) -> Iterator[Any]:
    """``pytest.warns(NumGuardWarning, match=pattern)`` for a run whose guard also warns of other root causes
    (later steps, other places): every ``NumGuardWarning`` is caught, none re-emitted into the suite's warnings
    summary, and one of them must match ``pattern``."""
    with pytest.warns(NumGuardWarning) as records:
        yield records
    messages = [str(r.message) for r in records if issubclass(r.category, NumGuardWarning)]
    assert any(re.search(pattern, m) for m in messages), (pattern, messages)


def guard_warning(culprit: str, step: int | None = None) -> str:
    """A ``pytest.warns(match=...)`` pattern: the guard's warning naming ``culprit`` at ``step`` on rank 0.

    ``culprit`` is literal text of the message (a place such as ``batch['x']``); ``step=None``
    accepts any step.
    """
    at = r"\d+" if step is None else str(step)
    return rf"^NumGuard: .*{re.escape(culprit)}.* at step {at} on rank 0"


class SyncWindow(pl.Callback):
    """A ``SyncCounter`` step window around each training batch (list the guard after it, so that the guard's
    ``on_train_batch_end`` runs inside the window)."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter

    def on_train_batch_start(self, *args: Any) -> None:
        self.counter.step_started()

    def on_train_batch_end(self, *args: Any) -> None:
        self.counter.step_ended()


def spike_window(guard: Any) -> Any:
    """The guard's spike window, rebuilt from its public state (``guard.state_dict()["spike"]``, what a checkpoint
    holds) as a :class:`~lightning_numguard.detect.spike.SpikeWindow`; ``None`` without spike statistics."""
    from lightning_numguard.detect.spike import SpikeWindow

    state = guard.state_dict()["spike"]
    if not state.get("window"):
        return None
    window = SpikeWindow(window=guard.spikes.window, warmup=guard.spikes.judged_after, sigma=guard.spikes.sigma)
    window.load_state_dict(state["window"])
    return window
