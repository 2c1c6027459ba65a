"""Reproducible or not: whether a step's non-finite value comes back when the step is re-run.

After a hit the replay (:func:`~lightning_numguard.diagnose.replay.replay`) re-runs the step with the same weights,
inputs and RNG, so it is also the test of reproducibility. When it does not make the non-finite value again, the
code and the data are innocent: the value was a transient fault of the device (silent data corruption: a flipped
bit, a flaky core). Under data parallelism, where every rank holds the same weights, a neighbour rank re-runs the
bad rank's micro-batch (its tensors and RNG sent only after a hit) to tell the three apart:

=================  ======================  =====================================================
the bad rank's     the neighbour's replay  verdict
own replay
=================  ======================  =====================================================
finite             (not run)               ``transient``: a transient fault of the bad rank's device
non-finite again   finite                  ``this_rank``: a fault of the bad rank's device
non-finite again   non-finite              ``data_or_code``: the data or the code
=================  ======================  =====================================================

Megatron-LM's ``RerunStateMachine`` tells the same apart by checkpointing, exiting and restarting the job; here it
is online, in the step that went bad. The verdict is judged only for a value the forward or backward pass made on a
rank that saw it, with finite inputs and state (a bad batch or weight reproduces by construction) and no op-domain
violation (the op guard's repair makes the replay finite); a compiled module's step replays eagerly, so a value
that does not come back there may be the compiler's (verdict ``compiled``, not counted as a device fault).
Every function here is collective (every rank holds the same flags, so every rank takes the same branches).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_numguard.detect import flags
from lightning_numguard.diagnose.findings import Finding
from lightning_numguard.diagnose.replay import Replay
from lightning_numguard.engine.loop import Loop
from lightning_numguard.tree import map_tree

__all__ = ["DEVICE_FAULTS", "Verdict", "judge_reproduction", "suspect_rank"]

#: the verdicts that are faults of a device (counted per rank: ``recovery.max_device_faults``)
DEVICE_FAULTS = ("transient", "this_rank")
#: the kinds whose value the forward or backward pass made (the replay's verdict goes into their details)
_MADE = ("nonfinite_output", "nonfinite_loss", "nonfinite_grad")

Rerun = Callable[[Any, int, "dict[str, Any] | None"], Replay]


@dataclass(frozen=True)
class Verdict:
    """Whether the bad rank's non-finite value came back when its step was re-run, and what that says.

    Attributes:
        verdict: ``"transient"``, ``"this_rank"``, ``"data_or_code"`` or ``"compiled"`` (see the module).
        rank: the rank that saw the value; ``host`` and ``device``: where it ran.
        reproduced: whether the bad rank's own replay made it again.
        neighbour: the rank that re-ran the bad rank's micro-batch (``-1``: none did), and whether it made it too.
    """

    verdict: str
    rank: int
    host: str
    device: str
    reproduced: bool
    neighbour: int = -1
    neighbour_reproduced: bool | None = None

    def details(self) -> dict[str, Any]:
        """What a finding of the bad rank carries: ``reproduced``, the neighbour's re-run, and the device fault."""
        out: dict[str, Any] = {"reproduced": self.reproduced}
        if self.neighbour >= 0:
            out["neighbour"] = {"rank": self.neighbour, "reproduced": self.neighbour_reproduced}
        if self.verdict in DEVICE_FAULTS:
            out["device_fault"] = {"verdict": self.verdict, "rank": self.rank, "host": self.host, "device": self.device}
        elif self.verdict == "compiled":
            out["compiled"] = True
        return out

    def mark(self, findings: list[Finding], rank: int) -> list[Finding]:
        """``findings`` (this rank's) with the verdict in the details of those the forward or backward pass made on
        the bad rank."""
        if rank != self.rank:
            return findings
        said = self.details()
        return [replace(f, details={**f.details, **said}) if f.kind in _MADE else f for f in findings]


def suspect_rank(seen: flags.StepFlags, state_bad: bool, grads_bad: bool, world: int) -> int | None:
    """The rank whose forward or backward pass made the step's first non-finite value, when its reproducibility
    says something: ``None`` when the batch, the state or an op's domain explain it, or nothing was made."""
    if state_bad or seen.seen(flags.INPUT) or seen.seen(flags.SUSPICIOUS) or seen.seen(flags.OP):
        return None
    for slot in (flags.OUTPUT, flags.LOSS):
        if seen.seen(slot):
            return seen.rank(slot)
    if grads_bad and world == 1:  # under DDP the gradients are averaged: every rank's flag is set, none is named
        return 0
    return None


def judge_reproduction(
    loop: Loop, rank: int, rep: Replay, batch: Any, batch_idx: int, rng: dict[str, Any] | None, rerun: Rerun,
    compiled: bool,
) -> Verdict | None:  # fmt: skip
    """The verdict on rank ``rank``'s non-finite value (collective), from its own replay ``rep`` (on that rank) and,
    under data parallelism, a neighbour's re-run of ``batch`` (``rerun(batch, batch_idx, rng)``, on the neighbour
    only). ``None`` when no verdict can be given: the replay did not run or raised, or the passes are collective
    (sharded parameters: no rank can re-run another's micro-batch alone)."""
    world = loop.world_size
    if world > 1 and not loop.replicated:
        return None
    mine = rep.again if loop.rank == rank else None
    own = loop.broadcast(mine, rank) if world > 1 else mine
    if own is None:  # the bad rank's replay did not run, or raised: no verdict
        return None
    host, device = loop.broadcast(_where(loop), rank) if world > 1 else _where(loop)
    if not own:
        return Verdict("compiled" if compiled else "transient", rank, host, device, reproduced=False)
    if world == 1:
        return Verdict("data_or_code", rank, host, device, reproduced=True)
    neighbour = (rank + 1) % world
    sent = loop.broadcast((_to_cpu(batch), batch_idx, rng) if loop.rank == rank else None, rank)
    theirs: bool | None = None
    if loop.rank == neighbour:
        other_batch, other_idx, other_rng = sent
        # a re-run that raised proves nothing: the device is not blamed on it
        theirs = rerun(_to_device(other_batch, loop.device), other_idx, other_rng).again is not False
    again = bool(loop.broadcast(theirs, neighbour))
    verdict = "data_or_code" if again else "this_rank"
    return Verdict(verdict, rank, host, device, reproduced=True, neighbour=neighbour, neighbour_reproduced=again)


def _where(loop: Loop) -> tuple[str, str]:
    """This rank's host and device."""
    return socket.gethostname(), str(loop.device)


def _to_cpu(batch: Any) -> Any:
    return map_tree(lambda x, _: x.detach().cpu() if isinstance(x, torch.Tensor) else x, batch)


def _to_device(batch: Any, device: torch.device) -> Any:
    return map_tree(lambda x, _: x.to(device) if isinstance(x, torch.Tensor) else x, batch)
