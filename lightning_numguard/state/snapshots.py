"""The verified-finite snapshots of a fit: taken, copied asynchronously, gathered and put back.

:class:`Snapshots` is the one holder of the state a rollback returns to. Read at the step
(``sync_mode="every_step"``), the state at a step's start becomes the snapshot once that step's read verified
it (:meth:`~Snapshots.take`, or the asynchronous candidate of :meth:`~Snapshots.start`). Read one step late
(``sync_mode="deferred"``), the deferred schedule keeps its own candidates
(:class:`~lightning_numguard.engine.deferred.Candidates`: :meth:`~Snapshots.candidate` captures one,
:meth:`~Snapshots.promote` makes a verified one the snapshot).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.record import StepRecord
from lightning_numguard.state import gather as _sharded
from lightning_numguard.state.snapshot import (
    PendingCapture,
    Snapshot,
    Stateful,
    capture,
    finish_capture,
    restore,
    start_capture,
)

__all__ = ["LateCandidates", "Snapshots", "SnapshotsView"]


class LateCandidates(NamedTuple):
    """The deferred read's snapshots: ``candidates`` not verified yet (``(step, Snapshot)``, oldest first) and
    ``last``, the last verified one (what a late rollback restores), or ``None``."""

    candidates: tuple[tuple[int, Snapshot], ...]
    last: tuple[int, Snapshot] | None


class SnapshotsView:
    """A read-only view of a fit's :class:`Snapshots` (``NumGuardCallback.snapshots``): what they hold, none of the
    verbs (take, restore, verify...), and no attribute can be set through it. The snapshots it shows are the
    guard's own storage: read them, do not write into their tensors."""

    __slots__ = ("_late", "_of")
    _of: Snapshots
    _late: LateCandidates

    def __init__(self, of: Snapshots, late: LateCandidates | None = None) -> None:
        object.__setattr__(self, "_of", of)
        object.__setattr__(self, "_late", late if late is not None else LateCandidates((), None))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"NumGuardCallback.snapshots is read-only (cannot set {name!r})")

    @property
    def snapshot(self) -> Snapshot | None:
        """The last verified-finite snapshot (``step``, ``nbytes``, ``model``, ``optimizers``...), or ``None``."""
        return self._of.snapshot

    @property
    def async_on(self) -> bool:
        """Whether snapshots are copied asynchronously in this fit (resolved at train start)."""
        return self._of.async_on

    @property
    def spare(self) -> Snapshot | None:
        """The second buffer the asynchronous copies go into (``None`` until one was needed)."""
        return self._of.spare

    @property
    def pending(self) -> Any:
        """The asynchronous candidate in flight, between its batch start and the read (else ``None``)."""
        return self._of.pending

    @property
    def late(self) -> LateCandidates:
        """``sync_mode="deferred"``: the candidates not verified yet and the last verified snapshot."""
        return self._late


class Snapshots:
    """The last verified-finite snapshot of a fit and the candidates that may replace it.

    Args:
        device: ``"host"`` or ``"device"``.
        sharding: ``"auto"``: under DDP with several ranks, each keeps only its ``1/world`` of the parameters and
            optimizer state, gathered back (collectively) to restore; ``"off"``: full copies.
        asynchronous: copy the parameters and optimizer state of a snapshot step from its batch start on,
            overlapped with the forward and backward passes, into a spare snapshot (double buffering); the
            candidate is promoted at the read only if the state it copied is verified finite. ``None``: on
            when the module is on CUDA and snapshots go to the host (resolved at train start).
    """

    def __init__(self, device: str, sharding: str = "off", asynchronous: bool | None = False) -> None:
        self.device = device
        self.sharding = sharding
        self.asynchronous = asynchronous
        self.snapshot: Snapshot | None = None
        self.async_on = False  # resolved at train start
        self.spare: Snapshot | None = None  # the storage the next candidate is copied into
        self.pending: PendingCapture | None = None  # the asynchronous candidate in flight (batch start to read)
        self.last_step = -(10**9)
        self.stateful: dict[str, Stateful] = {}
        self._dtensors = True  # whether a capture looks for DTensor local shards (not after one that found none)

    def track(self, stateful: dict[str, Stateful]) -> None:
        """Fit start: the stateful objects (metrics, loops, the spike window...) every snapshot holds."""
        self.stateful = stateful
        self._dtensors = True

    @property
    def where(self) -> Literal["host", "device"]:
        return "host" if self.device == "host" else "device"

    def resolve_async(self, loop: Loop) -> None:
        """Train start: asynchronous copies on when asked, or by default on CUDA with host snapshots."""
        auto = loop.device.type == "cuda" and self.device == "host"
        self.async_on = auto if self.asynchronous is None else self.asynchronous

    # ------------------------------------------------------------------ read at the step

    def start(self, loop: Loop, due: bool) -> None:
        """Batch start of a step whose snapshot is ``due``: start copying into the spare (asynchronous only)."""
        if not due or self.pending is not None or not self.async_on:
            return
        self.pending = start_capture(
            loop.module,
            loop.optimizers,
            step=loop.step,
            where=self.where,
            reuse=self.spare,  # never the verified snapshot: it stays whole until the candidate is verified
            shard_among=_sharded.shard_among(loop, self.sharding),
            backend="stream" if loop.device.type == "cuda" else "thread",
        )

    def settle(self) -> None:
        """After the read: a candidate not promoted (the state it copied was not verified) is discarded."""
        if self.pending is not None:
            self.pending.copies.synchronize()  # nothing may overwrite its sources (a restore) before it is done
            self.pending = None

    def take(self, loop: Loop, rec: StepRecord | None = None) -> None:
        """Keep the state at the start of this step (just verified finite), or the live state without ``rec``."""
        pending = self.pending
        if pending is not None and rec is not None and pending.step == rec.step:
            candidate = finish_capture(
                pending,
                loop.module,
                loop.optimizers,
                self.stateful,
                rng=rec.micro[0].rng if rec.micro else rec.start_rng,
                model_state=rec.start_buffers,
                stateful_state=rec.start_states,
            )
            pending.wait()  # the optimizer step, queued next, cannot overwrite a source before it is copied
            self.pending = None
            self.spare, self.snapshot = self.snapshot, candidate  # the old verified snapshot becomes the spare
            self.last_step = candidate.step
            return
        self.settle()
        if self.snapshot is not None:
            self.snapshot.ready()  # an asynchronous snapshot's copies are done before its storage is reused
        self.snapshot = self._capture(loop, rec, reuse=self.snapshot)
        self.last_step = self.snapshot.step

    # ------------------------------------------------------------------ candidates a late read verifies

    def candidate(self, loop: Loop, rec: StepRecord) -> Snapshot:
        """The state at ``rec``'s start, captured into the spare's storage (no collective): a candidate that
        :meth:`promote` makes the snapshot once verified."""
        taken = self._capture(loop, rec, reuse=self.spare)
        self.spare = None
        self.last_step = rec.step
        return taken

    def promote(self, snapshot: Snapshot, spare: Snapshot | None) -> None:
        """A verified candidate becomes the snapshot; ``spare``, the one it replaces, is reused for the next."""
        if spare is not None:
            self.spare = spare
        self.snapshot = snapshot

    # ------------------------------------------------------------------ putting back

    def full(self, loop: Loop) -> Snapshot:
        """The whole snapshot (gathered from every rank when sharded: then collective)."""
        assert self.snapshot is not None
        return _sharded.gather_snapshot(loop, self.snapshot.ready())

    def restore(self, loop: Loop, restore_rng: bool = True) -> None:
        """Put the snapshot back in place."""
        restore(self.full(loop), loop.module, loop.optimizers, self.stateful, restore_rng=restore_rng)

    def _capture(self, loop: Loop, rec: StepRecord | None, reuse: Any) -> Snapshot:
        taken = capture(
            loop.module,
            loop.optimizers,
            self.stateful,
            step=rec.step if rec is not None else loop.step,
            where=self.where,
            rng=(rec.micro[0].rng if rec.micro else rec.start_rng) if rec is not None else None,  # window start
            model_state=rec.start_buffers if rec is not None else None,
            stateful_state=rec.start_states if rec is not None else None,
            reuse=reuse,
            shard_among=_sharded.shard_among(loop, self.sharding),  # no collective: only the restores gather
            dtensors=self._dtensors,
        )
        self._dtensors = bool(taken.specs)  # a fit's state holds DTensors from its first capture on, or never
        return taken
