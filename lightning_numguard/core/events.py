"""The incident record and its JSON-lines codec."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["ACTIONS", "KINDS", "Event", "JsonlWriter", "read_jsonl"]

Kind = Literal[
    "nonfinite_input",
    "suspicious_input",
    "nonfinite_output",
    "op_domain",
    "nonfinite_loss",
    "nonfinite_grad",
    "nonfinite_param",
    "optimizer_coverage",
]
#: Incident kinds in causal order: the order events of one step are recorded in.
KINDS: tuple[str, ...] = (
    "optimizer_coverage",
    "nonfinite_input",
    "suspicious_input",
    "nonfinite_param",
    "nonfinite_output",
    "op_domain",
    "nonfinite_loss",
    "nonfinite_grad",
)
ACTIONS: tuple[str, ...] = ("warn", "skip", "rollback", "halt", "none")


@dataclass
class Event:
    """One incident.

    Attributes:
        kind: one of :data:`KINDS`.
        step: the global step (optimizer steps completed before this one).
        epoch: the epoch.
        batch_idx: the batch index within the epoch.
        rank: the global rank where the value was seen (the lowest, when several).
        where: names of what went bad: ``batch['x']``, a module's qualified name, a parameter's
            name, an op's name.
        action: what was done: ``warn``, ``skip``, ``rollback``, ``halt`` or ``none``.
        message: one human sentence with the hint.
        details: numbers behind the message (counts, max-|x|, first bad indices…).
    """

    kind: str
    step: int
    epoch: int
    batch_idx: int
    rank: int
    where: list[str]
    action: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``)."""
        return _json_safe(asdict(self))


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


class JsonlWriter:
    """Appends one JSON object per line to ``path``, flushing after every write.

    The file is opened lazily, on the first write, so that an object holding a writer can be
    pickled (``ddp_spawn``) before anything was written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fh: Any = None

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        """Append ``records``."""
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")
        for record in records:
            self._fh.write(json.dumps(_json_safe(record), sort_keys=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file (a later write reopens it)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_fh": None}


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The objects of a JSON-lines file; blank lines are skipped, a corrupt line raises ``ValueError``."""
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({err.msg})") from None
