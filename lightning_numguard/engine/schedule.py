"""When a step's packed flags are read: the read schedule, one interface for both ``sync_mode`` values.

The step's order is written once, in :class:`~lightning_numguard.engine.flow.StepFlow`; the schedule is the one
part that differs between the modes:

* :class:`EveryStep` (``sync_mode="every_step"``): the step's one host read at its optimizer step
  (:meth:`StepPipeline.read <lightning_numguard.engine.pipeline.StepPipeline.read>`);
* :class:`~lightning_numguard.engine.deferred.Deferred` (``sync_mode="deferred"``): the flags pushed without
  blocking, read and judged one step late.
"""

from __future__ import annotations

from typing import Any

from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.pipeline import StepPipeline
from lightning_numguard.state.snapshots import LateCandidates

__all__ = ["EveryStep", "ReadSchedule"]


class ReadSchedule:
    """When the step's flags are read (the base does nothing outside the optimizer step)."""

    def __init__(self, pipeline: StepPipeline) -> None:
        self.pipeline = pipeline

    @property
    def late_candidates(self) -> LateCandidates:
        """The snapshot candidates a late read keeps until verified (none when the flags are read at the step)."""
        return LateCandidates((), None)

    def at_train_start(self, loop: Loop) -> None:
        """Once per fit, after the checkpoint's state is restored: refuse what the schedule cannot serve."""

    def at_optimizer_step(self, loop: Loop, optimizer: Any) -> None:
        """The step's gradients are known: read (or pack) its flags."""
        raise NotImplementedError

    def after_step(self, loop: Loop) -> None:
        """Batch end, before the step's decision is carried out."""

    def at_train_end(self, loop: Loop) -> None:
        """The fit's end: read what is still pending."""


class EveryStep(ReadSchedule):
    """``sync_mode="every_step"``: one host read per step, at its optimizer step."""

    def at_optimizer_step(self, loop: Loop, optimizer: Any) -> None:
        self.pipeline.read(loop, optimizer)
