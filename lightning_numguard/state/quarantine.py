"""Batches that failed before: their keys, matching a new batch against them, and their state.

A batch is identified by the sample indices it carries (``batch["index"]`` and the like), which
stay right after a mid-epoch resume and a reshuffle; without them, by its position in the epoch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["INDEX_KEYS", "Quarantine", "index_tensor", "parse_state", "position_key", "sample_indices"]

#: Batch keys that hold sample indices.
INDEX_KEYS: tuple[str, ...] = ("index", "indices", "idx", "sample_index", "sample_indices")


def index_tensor(batch: Any) -> torch.Tensor | None:
    """The integer sample-index tensor a mapping batch carries (flattened), if any."""
    if isinstance(batch, dict):
        for key in INDEX_KEYS:
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
                return value.reshape(-1)
    return None


def sample_indices(batch: Any) -> list[int] | None:
    """The batch's sample indices as a list. **Syncs**: after a hit only."""
    indices = index_tensor(batch)
    return [int(v) for v in indices.tolist()] if indices is not None else None


def position_key(batch: Any, batch_idx: int) -> str:
    """Where in the data an incident happened: ``samples:1,2,3`` when known, else ``batch:<idx>``."""
    samples = sample_indices(batch)
    return f"samples:{','.join(map(str, samples))}" if samples else f"batch:{batch_idx}"


class Quarantine:
    """The batches that failed twice (or failed a retry), and how often each position failed.

    Attributes:
        entries: one dict per quarantined batch: ``epoch``, ``batch_idx``, ``step``, ``reason``,
            ``sample_indices`` (or ``None``) and, once saved, ``file``.
        failures: incidents per :func:`position_key`.
    """

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.failures: dict[str, int] = {}
        self._known: tuple[int, torch.Tensor] | None = None

    def count_failure(self, key: str) -> int:
        """Record one more incident at ``key``; return how many it has had."""
        self.failures[key] = self.failures.get(key, 0) + 1
        return self.failures[key]

    def holds(self, batch_idx: int) -> bool:
        """Whether the batch position ``batch_idx`` is quarantined already."""
        return any(q["batch_idx"] == batch_idx for q in self.entries)

    def add(self, entry: dict[str, Any]) -> bool:
        """Quarantine ``entry`` (see :attr:`entries`); ``False`` if its position already is."""
        if self.holds(entry["batch_idx"]):
            return False
        self.entries.append(entry)
        return True

    def flag(self, batch: Any, batch_idx: int, step: int) -> torch.Tensor | None:
        """A 0-d device flag: does this batch hold quarantined samples? No sync; ``None`` when it cannot.

        By sample index when both the batch and the entries have them (the known indices are copied
        to the device once per change of the quarantine); otherwise by batch position, except at the
        step the entry was made.
        """
        if not self.entries:
            return None
        known = [i for q in self.entries for i in (q.get("sample_indices") or [])]
        indices = index_tensor(batch)
        if known and indices is not None:
            cached = self._known
            if cached is None or cached[0] != len(known) or cached[1].device != indices.device:
                cached = self._known = (len(known), torch.tensor(known, device=indices.device))
            return torch.isin(indices, cached[1]).any().float()
        if any(q["batch_idx"] == batch_idx and q["step"] != step and not q.get("sample_indices") for q in self.entries):
            return torch.ones(())
        return None

    def state_dict(self) -> dict[str, Any]:
        """Plain types only (loadable with ``weights_only=True``)."""
        return {"quarantined": [dict(q) for q in self.entries], "position_incidents": dict(self.failures)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (validate each part first with :func:`parse_state`)."""
        self.entries = parse_state("quarantined", state.get("quarantined", []))
        self.failures = parse_state("position_incidents", state.get("position_incidents", {}))
        self._known = None


def parse_state(key: str, raw: Any) -> Any:
    """One part of :meth:`Quarantine.state_dict` checked and copied; ``TypeError``/``ValueError`` if malformed."""
    if key == "quarantined":
        entries = [dict(q) for q in raw]
        if any(not isinstance(q.get("batch_idx"), int) for q in entries):
            raise TypeError("every entry needs an integer 'batch_idx'")
        return entries
    if key == "position_incidents":
        return {str(k): int(v) for k, v in raw.items()}
    raise KeyError(key)
