"""Rollbacks that repeat: a rollback landing on a snapshot already restored for the same kind of trouble.

A rollback restores the LR schedulers with the rest of the snapshot, so a schedule that raised the learning rate
(a warm-up restarted, a ``LambdaLR`` peak) brings the same steps round again, and the same trouble with them,
until ``max_rollbacks`` is spent. :class:`Repeats` tells such a loop from a new incident: the second rollback to
the same snapshot for the same kind of trouble is a *repeat*. A repeat restores the weights and the optimizer
state but keeps the schedule's place (as PaLM and OLMo recover: go back, and do not run the data, here the
scheduled steps, that blew up again; the data loader moves on as always); its events say so, and a halt after
``max_rollbacks`` names the cause the repeats share (for example a schedule that brings the learning rate back).
"""

from __future__ import annotations

from typing import Any

from lightning_numguard.engine.loop import Loop
from lightning_numguard.state.outcome import Restore

__all__ = ["Repeats", "Restores", "learning_rate", "put_schedule", "schedule"]


class Restores:
    """What each restore of a fit discards, and the rollbacks that repeat."""

    def __init__(self) -> None:
        self.restored_after = -1  # the live state holds no update of a step at or before this (the last restore)
        self.skipped: set[int] = set()  # steps whose update was not made (since the last restore)
        self.repeats = Repeats()  # the rollbacks per (snapshot, trouble): a repeat keeps the LR schedule's place

    def before(self, loop: Loop, rec: Any, snapshot: Any, new: bool) -> Restore | None:
        """A restore of ``rec``'s step to ``snapshot`` (``None`` when there is none): the updates it discards, the
        steps since the snapshot or the last restore whose update was made. A ``new`` rollback landing on a snapshot
        already restored for the same trouble is a repeat (its details in the returned :class:`Restore`)."""
        if snapshot is None:
            return None
        start = max(snapshot.step, self.restored_after + 1)
        lost = sum(1 for t in range(start, rec.step) if t not in self.skipped)
        self.restored_after = max(loop.step - 1, rec.step)
        self.skipped = {t for t in self.skipped if t > self.restored_after}
        root = next((e for e in rec.events if e.get("root_cause", True)), rec.events[0] if rec.events else None)
        repeat = None
        if new and root is not None:
            self.repeats.initial_lr = learning_rate(loop, "initial_lr")
            repeat = self.repeats.add(snapshot.step, root["kind"], rec.step, learning_rate(loop))
        return Restore(snapshot.step, lost, repeat)


class Repeats:
    """The rollbacks of a fit per (snapshot step, kind of trouble), to tell a loop from a new incident."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, str], list[tuple[int, float]]] = {}  # -> [(failing step, learning rate)]
        self.restored_lr: dict[tuple[int, str], float] = {}  # the learning rate the first restore put back
        self.cause: str | None = None  # what the repeats have in common, once there is one
        self._last: tuple[int, str] | None = None
        self.initial_lr = 0.0  # the schedule's base learning rate (``initial_lr`` of the parameter groups)

    def restored(self, lr: float) -> None:
        """The learning rate right after a restore (the snapshot's), kept for the first restore of each key."""
        if self._last is not None:
            self.restored_lr.setdefault(self._last, lr)

    def add(self, snapshot_step: int, kind: str, step: int, lr: float) -> dict[str, Any] | None:
        """Record a rollback to ``snapshot_step`` for ``kind`` at ``step``; a repeat's details, else ``None``."""
        trouble = "spike" if kind.endswith("_spike") else kind
        key = self._last = (snapshot_step, trouble)
        earlier = self.seen.setdefault(key, [])
        earlier.append((step, lr))
        if len(earlier) < 2:
            return None
        bases = [b for b in (self.restored_lr.get(key, 0.0), self.initial_lr) if b > 0]
        base = min(bases, default=0.0)
        if base > 0 and min(lr for _, lr in earlier) >= 2 * base:
            self.cause = (
                f"a schedule that brings the learning rate back: it was {earlier[0][1]:.3g} at step {earlier[0][0]} "
                f"and {lr:.3g} at step {step}, against {base:.3g} in the snapshot of step {snapshot_step} or at the "
                "schedule's start"
            )
        else:
            self.cause = f"{trouble} came back after each rollback to the snapshot of step {snapshot_step}"
        said = (
            f"a repeat ({len(earlier)} rollbacks to the snapshot of step {snapshot_step} for {trouble}, at steps "
            f"{', '.join(str(s) for s, _ in earlier)}): the learning-rate schedule is not rewound this time (it keeps "
            f"its place, so the scheduled steps that blew up are not run again; the data loader moves on as always); "
            f"{self.cause}"
        )
        return {"snapshot_step": snapshot_step, "times": len(earlier), "steps": [s for s, _ in earlier], "said": said}


def learning_rate(loop: Loop, key: str = "lr") -> float:
    """The largest learning rate (or ``key``: ``"initial_lr"``, a scheduler's base) of any parameter group."""
    return max((float(g.get(key, 0.0)) for o in loop.optimizers for g in o.param_groups), default=0.0)


def schedule(loop: Loop) -> tuple[list[dict[str, Any]], list[list[float]]]:
    """The LR schedulers' states and the live learning rates (host-side and tiny)."""
    schedulers = [s.state_dict() for s in loop.schedulers]
    return schedulers, [[g["lr"] for g in o.param_groups] for o in loop.optimizers]


def put_schedule(loop: Loop, kept: tuple[list[dict[str, Any]], list[list[float]]] | None) -> None:
    if kept is None:
        return
    for scheduler, state in zip(loop.schedulers, kept[0]):
        scheduler.load_state_dict(state)
    for opt, lrs in zip(loop.optimizers, kept[1]):
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
