"""Rollbacks that repeat: the same trouble coming back at the same place, whichever snapshot it rolls back to.

A rollback restores the LR schedulers with the rest of the snapshot, so a schedule that raised the learning rate
(a warm-up restarted, a ``LambdaLR`` peak, a glitch that returns ``inf`` for one step) brings the same steps round
again, and the same trouble with them; each new snapshot is a different one, so a loop is not told by the snapshot
alone. :class:`Repeats` keys each rollback by the :class:`Place` of its trouble: the kind at the place it was
named (``nonfinite_param`` at ``net.0.weight``), the LR schedulers' positions when it was read, and the batch. A new
rollback is a *repeat* when an earlier one had the same trouble at the same schedule position or on the same batch,
or went back to the same snapshot for the same kind of trouble. A repeat restores the weights and the optimizer state
but keeps the schedule's place (as PaLM and OLMo recover: go back, and do not run the data, here the scheduled
steps, that blew up again; the data loader moves on as always): the schedule moves past the position that failed,
and its events say which. A trouble that comes back a third time at the same place halts
(:func:`~lightning_numguard.decide.judge.judge`, ``Budget.same_place``): rolling back again would loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_numguard.engine.loop import Loop
from lightning_numguard.state.outcome import Restore

__all__ = ["Place", "Repeats", "Restores", "learning_rate", "place_of", "positions", "put_schedule", "schedule"]


@dataclass(frozen=True)
class Place:
    """Where a rollback's trouble happened: what comes back when the rollback replays it.

    Attributes:
        trouble: the kind of trouble (``"spike"`` for both kinds of spike, else the root event's kind).
        where: the first name the root event gives (a parameter, a module, ``loss``).
        schedule: the LR schedulers' positions (``last_epoch``) when the trouble was read (empty: no scheduler).
        batch: the batch's position in the data (:func:`~lightning_numguard.state.quarantine.position_key`).
    """

    trouble: str
    where: str
    schedule: tuple[int, ...] = ()
    batch: str | None = None

    def same(self, other: Place) -> str | None:
        """What ``other`` shares with this place for the same trouble (``"schedule"``, ``"batch"``), else ``None``."""
        if (self.trouble, self.where) != (other.trouble, other.where):
            return None
        if self.schedule and self.schedule == other.schedule:
            return "schedule"
        if self.batch is not None and self.batch == other.batch:
            return "batch"
        return None

    def said(self, shared: str) -> str:
        """The place in words (``shared``: what it shares with an earlier rollback)."""
        what = f"{self.trouble} at `{self.where}`"
        if shared == "schedule":
            return f"{what} at LR schedule position {_position(self.schedule)}"
        return f"{what} on the same batch ({self.batch})"


def place_of(loop: Loop, kind: str, where: list[str] | tuple[str, ...], batch: str | None) -> Place:
    """The :class:`Place` of a trouble read now (host numbers: the schedulers' positions)."""
    trouble = "spike" if kind.endswith("_spike") else kind
    return Place(trouble, where[0] if where else "", positions(loop.schedulers), batch)


def positions(schedulers: list[Any]) -> tuple[int, ...]:
    """Each LR scheduler's position (``last_epoch``: the steps, or epochs, it has been stepped)."""
    return tuple(int(getattr(s, "last_epoch", -1)) for s in schedulers)


def _position(values: tuple[int, ...] | list[int]) -> str:
    return str(values[0]) if len(values) == 1 else str(list(values))


class Restores:
    """What each restore of a fit discards, and the rollbacks that repeat."""

    def __init__(self) -> None:
        self.restored_after = -1  # the live state holds no update of a step at or before this (the last restore)
        self.skipped: set[int] = set()  # steps whose update was not made (since the last restore)
        self.repeats = Repeats()  # the rollbacks per place of their trouble: a repeat keeps the LR schedule's place

    def before(self, loop: Loop, rec: Any, snapshot: Any, new: bool, place: Place | None = None) -> Restore | None:
        """A restore of ``rec``'s step to ``snapshot`` (``None`` when there is none): the updates it discards, the
        steps since the snapshot or the last restore whose update was made. A ``new`` rollback whose trouble
        (``place``; else the kind of the step's root event) already came back at the same place or to the same
        snapshot is a repeat (its details in the returned :class:`Restore`)."""
        if snapshot is None:
            return None
        start = max(snapshot.step, self.restored_after + 1)
        lost = sum(1 for t in range(start, rec.step) if t not in self.skipped)
        self.restored_after = max(loop.step - 1, rec.step)
        self.skipped = {t for t in self.skipped if t > self.restored_after}
        root = next((e for e in rec.events if e.get("root_cause", True)), rec.events[0] if rec.events else None)
        repeat = None
        if new and root is not None:
            if place is None:
                place = place_of(loop, root["kind"], root["where"], None)
            self.repeats.initial_lr = learning_rate(loop, "initial_lr")
            repeat = self.repeats.add(
                snapshot.step, place, rec.step, learning_rate(loop), _schedule_kept(loop, snapshot)
            )
        return Restore(snapshot.step, lost, repeat)


def _schedule_kept(loop: Loop, snapshot: Any) -> dict[str, Any]:
    """A repeat's schedule: the positions the snapshot would have put back and those kept instead (with their
    learning rates), and the sentence saying so (empty without a scheduler)."""
    schedulers = loop.schedulers
    if not schedulers:
        return {}
    states = [snapshot.stateful.get(f"lr_scheduler:{i}") or {} for i in range(len(schedulers))]
    back = [int(s.get("last_epoch", -1)) for s in states]
    kept = list(positions(schedulers))
    lr_back = [float(v) for s in states for v in (s.get("_last_lr") or [])]
    lr_kept = [float(v) for s in schedulers if callable(getattr(s, "get_last_lr", None)) for v in s.get_last_lr()]
    said = f"it stays at position {_position(kept)}" + (f", lr {_rates(lr_kept)}," if lr_kept else "")
    said += f" instead of going back to position {_position(back)}" + (f", lr {_rates(lr_back)}," if lr_back else "")
    return {"schedule_skipped": {"from": back, "to": kept, "lr_from": lr_back, "lr_to": lr_kept}, "kept": said}


def _rates(values: list[float]) -> str:
    return ", ".join(f"{v:.3g}" for v in values)


class Repeats:
    """The rollbacks of a fit by the place of their trouble, to tell a loop from a new incident."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, str], list[tuple[int, float]]] = {}  # (snapshot, trouble) -> [(step, lr)]
        self.places: list[tuple[Place, int]] = []  # the place and the step of each new rollback, in order
        self.restored_lr: dict[tuple[int, str], float] = {}  # the learning rate the first restore put back
        self.cause: str | None = None  # what the repeats have in common, once there is one
        self._last: tuple[int, str] | None = None
        self.initial_lr = 0.0  # the schedule's base learning rate (``initial_lr`` of the parameter groups)

    def restored(self, lr: float) -> None:
        """The learning rate right after a restore (the snapshot's), kept for the first restore of each key."""
        if self._last is not None:
            self.restored_lr.setdefault(self._last, lr)

    def times_at(self, place: Place | None) -> tuple[int, str | None]:
        """How many earlier rollbacks had this trouble at the same place, and what they share (``"schedule"``,
        ``"batch"``; ``None`` when none did): a third at the same place halts instead."""
        if place is None:
            return 0, None
        shared = [s for s in (place.same(p) for p, _ in self.places) if s is not None]
        return len(shared), (shared[-1] if shared else None)

    def add(
        self, snapshot_step: int, place: Place, step: int, lr: float, kept: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """Record a rollback to ``snapshot_step`` for the trouble at ``place`` at ``step``; a repeat's details, else
        ``None`` (``kept``: the schedule a repeat keeps, with ``"kept"``, its sentence, and ``"schedule_skipped"``)."""
        trouble = place.trouble
        key = self._last = (snapshot_step, trouble)
        earlier = self.seen.setdefault(key, [])
        earlier.append((step, lr))
        same = [(p, s) for p, s in self.places if place.same(p) is not None]
        shared = place.same(same[-1][0]) if same else None
        self.places.append((place, step))
        if len(earlier) < 2 and not same:
            return None
        if len(earlier) >= 2:  # back to the same snapshot for the same kind of trouble
            bases = [b for b in (self.restored_lr.get(key, 0.0), self.initial_lr) if b > 0]
            base = min(bases, default=0.0)
            if base > 0 and min(lr for _, lr in earlier) >= 2 * base:
                self.cause = (
                    f"a schedule that brings the learning rate back: it was {earlier[0][1]:.3g} at step "
                    f"{earlier[0][0]} and {lr:.3g} at step {step}, against {base:.3g} in the snapshot of step "
                    f"{snapshot_step} or at the schedule's start"
                )
            else:
                self.cause = f"{trouble} came back after each rollback to the snapshot of step {snapshot_step}"
            steps = [s for s, _ in earlier]
            head = (
                f"a repeat ({len(earlier)} rollbacks to the snapshot of step {snapshot_step} for {trouble}, at steps "
            )
        else:  # the same trouble at the same place, from another snapshot
            assert shared is not None
            self.cause = f"{place.said(shared)} came back after each rollback"
            steps = [s for _, s in same] + [step]
            head = f"a repeat ({len(steps)} rollbacks for {place.said(shared)}, at steps "
        kept = kept or {}
        where = f": {kept['kept'].rstrip(',')}," if kept.get("kept") else ","
        said = (
            f"{head}{', '.join(str(s) for s in steps)}): the learning-rate schedule is not rewound this time (it keeps "
            f"its place{where} so the scheduled steps that blew up are not run again; the data loader moves on as "
            f"always); {self.cause}"
        )
        details = {"snapshot_step": snapshot_step, "times": len(steps), "steps": steps, "said": said}
        if "schedule_skipped" in kept:
            details["schedule_skipped"] = kept["schedule_skipped"]
        return details


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
