"""What every front door shows of a guard: its events, counters, quarantine and snapshots, and its state.

:class:`GuardState` is the public state of a guard whatever loop it guards (``NumGuardCallback``, the Fabric
``NumGuard``, the handle ``attach`` returns): read-only views of the running fit's parts, and the ``state_dict`` /
``load_state_dict`` pair that carries the counters, the quarantine and the spike window across a resume. A door
holds its :class:`~lightning_numguard.engine.flow.StepFlow` as ``_flow``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_numguard.engine.flow import StepFlow
from lightning_numguard.engine.pipeline import StepPipeline
from lightning_numguard.errors import NumGuardError
from lightning_numguard.state.quarantine import parse_state
from lightning_numguard.state.snapshots import SnapshotsView

__all__ = ["STATE_VERSION", "GuardState"]

#: the layout of :meth:`GuardState.state_dict`; ``load_state_dict`` refuses any other
STATE_VERSION = 1


class GuardState:
    """The public state of a guard (see the module)."""

    _flow: StepFlow

    @property
    def _pipeline(self) -> StepPipeline:
        """The parts of the current fit (the flow's pipeline)."""
        return self._flow.pipeline

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event recorded so far in this fit (the same content as ``events.jsonl``)."""
        return self._pipeline.ledger.events

    @property
    def counters(self) -> dict[str, int]:
        """``incidents``, ``skipped_steps``, ``rollbacks``, ``amp_overflow_steps`` and ``spikes`` so far."""
        return self._pipeline.ledger.counters

    @property
    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantined batches (epoch, batch_idx, step, reason, sample_indices, file)."""
        return self._pipeline.recovery.quarantine.entries

    @property
    def snapshots(self) -> SnapshotsView:
        """A read-only view of the fit's verified-finite snapshots (``snapshot``, ``async_on``, ``spare``,
        ``pending``, ``late``); only the guard changes them."""
        return SnapshotsView(self._pipeline.snapshots, self._flow.schedule.late_candidates)

    @property
    def snapshot_step(self) -> int | None:
        """The step whose start state the last verified-finite snapshot holds (``None`` before the first)."""
        snapshot = self._pipeline.snapshots.snapshot
        return snapshot.step if snapshot is not None else None

    @property
    def resolved_dirpath(self) -> Path | None:
        """The folder events and checkpoints are written to (known from the fit's start on)."""
        reporter = self._pipeline.reporter
        return reporter.dirpath if reporter is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The guard's state (plain types): counters, incident counts, the quarantine, the spike window, and the
        ``events.jsonl`` of this run and the runs it resumed from (``events_files``, absolute paths, oldest first:
        a resumed run's summary points at the events of the run it resumed from)."""
        return {
            "version": STATE_VERSION,
            "counters": dict(self.counters),
            "incidents_by_kind": dict(self._pipeline.ledger.incidents_by_kind),
            # per rank (a string key: plain types): its host, device and faults by verdict
            "device_faults": {str(k): dict(v) for k, v in self._pipeline.ledger.device_faults.items()},
            **self._pipeline.recovery.quarantine.state_dict(),
            "spike": self._pipeline.spike.state_dict(),
            "events_files": self._pipeline.ledger.events_files(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters, the quarantine and incident counts; nothing is changed if any part is malformed or the
        state is of a version this release does not know."""
        version = state_dict.get("version", STATE_VERSION)
        if type(version) is not int or version != STATE_VERSION:
            raise NumGuardError(
                f"NumGuard: the guard's state in this checkpoint has version {version!r}; this release reads version "
                f"{STATE_VERSION}. Resume with the release that wrote it (or upgrade lightning-numguard), or resume "
                "without the guard's state (for a Trainer: by removing checkpoint['callbacks'] entries for "
                "NumGuardCallback); the checkpoint's weights are unaffected."
            )
        parsers = {
            "counters": lambda raw: {str(k): int(v) for k, v in raw.items()},
            "quarantined": lambda raw: parse_state("quarantined", raw),
            "position_incidents": lambda raw: parse_state("position_incidents", raw),
            "incidents_by_kind": lambda raw: {str(k): int(v) for k, v in raw.items()},
            "events_files": _paths,
            "device_faults": _device_faults,
        }
        parsed: dict[str, Any] = {}
        for key, parse in parsers.items():
            try:
                parsed[key] = parse(state_dict.get(key, [] if key in ("quarantined", "events_files") else {}))
            except (AttributeError, TypeError, ValueError) as err:
                raise NumGuardError(
                    f"NumGuard: the guard's state in this checkpoint is malformed at {key!r} ({err}); the "
                    "checkpoint's weights are unaffected: resume without the guard's state (for a Trainer: by removing "
                    "checkpoint['callbacks'] entries for NumGuardCallback), or from another checkpoint."
                ) from None
        try:
            self._pipeline.spike.load_state_dict(dict(state_dict.get("spike") or {}))
        except (AttributeError, TypeError, ValueError, KeyError) as err:
            raise NumGuardError(
                f"NumGuard: the guard's state in this checkpoint is malformed at 'spike' ({err}); the checkpoint's "
                "weights are unaffected: resume without the guard's state, or from another checkpoint."
            ) from None
        self._pipeline.ledger.load(
            parsed["counters"], parsed["incidents_by_kind"], parsed["events_files"], parsed["device_faults"]
        )
        self._pipeline.recovery.quarantine.load_state_dict(parsed)


def _paths(raw: Any) -> list[str]:
    """``events_files`` of a checkpoint: a list of paths (strings)."""
    if not isinstance(raw, (list, tuple)) or not all(isinstance(p, str) for p in raw):
        raise TypeError(f"expected a list of paths, got {raw!r}")
    return list(raw)


def _device_faults(raw: Any) -> dict[int, dict[str, Any]]:
    """The device faults of a checkpoint: per rank, its host and device (strings) and its faults by verdict."""
    out: dict[int, dict[str, Any]] = {}
    for rank, entry in raw.items():
        host, device = entry.get("host"), entry.get("device")
        counts = {str(k): int(v) for k, v in entry.items() if k not in ("host", "device")}
        out[int(rank)] = {
            "host": None if host is None else str(host),
            "device": None if device is None else str(device),
        }
        out[int(rank)].update(counts)
    return out
