"""Micro-batch bookkeeping under gradient accumulation: each micro-batch's RNG, and which one went bad.

A window of ``accumulate_grad_batches`` micro-batches is read once, at its optimizer step. After a hit the
guard names, quarantines, retries and replays the micro-batch that went bad, from the RNG state it started
with (dropout draws differ per micro-batch). Only the torch generators are kept per micro-batch (a few KB,
no sync); Python's ``random`` state is the window's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_numguard.detect.checks import as_f32
from lightning_numguard.engine import group as _distributed
from lightning_numguard.engine.loop import Loop
from lightning_numguard.state.rng import rng_state

if TYPE_CHECKING:
    from lightning_numguard.detect.watch import OutputWatch
    from lightning_numguard.engine.record import StepRecord

__all__ = ["MicroBatch", "first_bad", "merged_flag", "micro_rng"]


@dataclass
class MicroBatch:
    """One micro-batch of an accumulation window: its batch and what it recorded (device tensors, no sync)."""

    batch_idx: int
    batch: Any
    inputs: list[torch.Tensor] = field(default_factory=list)  # its inputs' 0-d ends: non-finite when an input is
    loss: torch.Tensor | None = None
    first_output: int = 0  # index of its first record in the output watch
    rng: dict[str, Any] | None = None  # the RNG state at its start (see _micro.micro_rng)


def micro_rng(window_rng: dict[str, Any]) -> dict[str, Any]:
    """The RNG state at the start of a later micro-batch: the torch CPU/CUDA generators now, Python's of the window
    (each only when the window kept it: :class:`~lightning_numguard.state.rng.StepRng`)."""
    state = rng_state(tuple(s for s in ("torch", "cuda") if s in window_rng))
    if "python" in window_rng:
        state["python"] = window_rng["python"]
    return state


def merged_flag(old: torch.Tensor | None, flag: torch.Tensor) -> torch.Tensor:
    """The window's quarantine flag with a later micro-batch's folded in (device-side, no sync)."""
    return flag if old is None else torch.maximum(old, flag.to(old.device))


def first_bad(loop: Loop | None, rec: StepRecord, watch: OutputWatch | None) -> int:
    """Index in ``rec.micro`` of the first micro-batch whose input, loss or watched output is non-finite.

    ``0`` when none of them says (a bad gradient or state). Across ranks, the first bad index of any rank, so
    every rank names the same position of the window (one all-reduce). Syncs; after a hit only.
    """
    first_micro = rec.micro[0]
    device = first_micro.inputs[0].device if first_micro.inputs else torch.device("cpu")
    bounds = [m.first_output for m in rec.micro] + [len(watch.records) if watch is not None else 0]
    totals = []
    for i, m in enumerate(rec.micro):
        outputs = watch.record_tensors(bounds[i], bounds[i + 1]) if watch is not None else []
        values = [*m.inputs, *([m.loss] if m.loss is not None else []), *outputs]
        parts = [as_f32(x.detach().to(device).abs().amax()) for x in values]  # NaN and Inf propagate
        totals.append(torch.stack(parts).amax() if parts else torch.zeros((), device=device))
    finite = torch.isfinite(torch.stack(totals)).tolist()
    n = len(rec.micro)
    first = next((i for i, ok in enumerate(finite) if not ok), n)
    if loop is not None and loop.world_size > 1:
        first = -int(_distributed.reduce_max(loop, torch.tensor([-first], device=loop.root_device))[0])
    return first if first < n else 0
