"""The incident record: its schema, and the one JSON-lines writer and reader of ``events.jsonl``."""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args, get_origin, get_type_hints

from lightning_numguard.detect import registry

__all__ = [
    "ACTING_ACTIONS",
    "ACTIONS",
    "ADVISORY_KINDS",
    "KINDS",
    "REQUIRED_FIELDS",
    "SPIKE_ACTIONS",
    "Action",
    "Event",
    "JsonlWriter",
    "acting",
    "counts_as_incident",
    "field_docs",
    "read_events",
    "validate_event",
]

#: Incident kinds in causal order: the order events of one step are recorded in (declared by ``core/registry``).
KINDS: tuple[str, ...] = registry.kinds()
#: Kinds that warn ahead of trouble and are not counted as incidents (no step was bad).
ADVISORY_KINDS: tuple[str, ...] = registry.advisory_kinds()
#: What the guard may be told to do on an incident (``NumGuardCallback(action=...)``).
Action = Literal["warn", "skip", "rollback", "halt"]
#: Every value of an event's ``action``: an :data:`Action`, or ``"none"`` for a finding only reported.
ACTIONS: tuple[str, ...] = (*get_args(Action), "none")
#: The actions that act on a step (its optimizer step becomes a no-op); ``"warn"`` only reports.
ACTING_ACTIONS: tuple[str, ...] = ("skip", "rollback", "halt")
#: What ``NumGuardCallback(spike_action=...)`` may be told to do on a finite spike.
SPIKE_ACTIONS: tuple[str, ...] = ("warn", "skip", "rollback")


def acting(action: str | None) -> bool:
    """Whether ``action`` acts on a step (skips, rolls back or halts) rather than only reporting."""
    return action in ACTING_ACTIONS


def _doc(line: str) -> dict[str, str]:
    """A field's metadata: its one documentation line."""
    return {"doc": line}


@dataclass
class Event:
    """One incident, as ``callback.events`` holds it and each ``events.jsonl`` line writes it.

    Each field's documentation is declared with it (``field_docs``); ``docs/reference.md`` renders
    the same declaration as its table of fields.
    """

    kind: str = field(metadata=_doc("one of the incident kinds (``KINDS``, in causal order; the README lists them)"))
    step: int = field(metadata=_doc("the global step (optimizer steps completed before this one)"))
    epoch: int = field(metadata=_doc("the epoch"))
    batch_idx: int = field(metadata=_doc("the batch index within the epoch"))
    rank: int = field(metadata=_doc("the global rank that saw it (the lowest, when several did)"))
    where: list[str] = field(
        metadata=_doc(
            "names of what went bad, all of one kind: batch paths (``batch['x']``), a module's qualified name, "
            "parameters, buffers or optimizer-state entries, or an op"
        )
    )
    action: str = field(
        metadata=_doc(
            "what was done: "
            + ", ".join(f"``{a}``" for a in ACTIONS[:-1])
            + f", or ``{ACTIONS[-1]}`` for a finding only reported"
        )
    )
    message: str = field(metadata=_doc("one human sentence with the hint"))
    details: dict[str, Any] = field(
        default_factory=dict,
        metadata=_doc(
            "the numbers behind the message, by kind: values, counts, max-|x|, first bad indices, the replay's op "
            "and node, ``lr_after_backoff``, ``retry``, ``quarantined``; for a rollback or halt ``snapshot_step`` "
            "and ``steps_lost`` (the updates the restore discarded), and ``repeat`` when it landed again on a "
            "snapshot restored for the same trouble; ``persistent`` for a batch field flagged on step after step; "
            "for spikes ``value``, ``zscore``, ``sigma``, ``window`` (the steps the window spanned), "
            "``window_size`` (and ``escalated``); for ``overflow_risk`` ``peak``, ``dtype``, ``limit``, "
            "``headroom`` (limit / peak), ``factor``, …"
        ),
    )
    op: str | None = field(
        default=None,
        metadata=_doc(
            "the first op that made the values non-finite (``div``, ``SqrtBackward0``), when the replay named it"
        ),
    )
    module: str | None = field(default=None, metadata=_doc("the module that op ran in, when known"))
    site: str | None = field(
        default=None,
        metadata=_doc("for ``nonfinite_param``, what holds the values: ``param``, ``buffer`` or ``optimizer_state``"),
    )
    source: str | None = field(
        default=None, metadata=_doc("``file:line`` of the user's code that ran the op, when known")
    )
    root_cause: bool = field(
        default=True,
        metadata=_doc(
            "``false`` for a consequence of an earlier event of the same step (consequences are not counted as "
            "incidents)"
        ),
    )
    consequence_of: str | None = field(
        default=None, metadata=_doc("for a consequence, the kind of its step's root cause")
    )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``)."""
        return _json_safe(asdict(self))


def _json_type(hint: Any) -> type:
    origin = get_origin(hint)
    return origin if isinstance(origin, type) else hint  # list[str] -> list


#: The fields every ``events.jsonl`` line must have, with their JSON types (``details`` is optional).
REQUIRED_FIELDS: Mapping[str, type] = MappingProxyType(
    {
        f.name: _json_type(get_type_hints(Event)[f.name])
        for f in fields(Event)
        if f.default is MISSING and f.default_factory is MISSING
    }
)


def field_docs(cls: type = Event) -> dict[str, str]:
    """Each field of the dataclass ``cls`` with its documentation line, in declaration order.

    Raises:
        TypeError: a field was declared without one (``metadata["doc"]``).
    """
    docs = {f.name: f.metadata.get("doc", "") for f in fields(cls)}
    missing = [name for name, doc in docs.items() if not doc]
    if missing:
        raise TypeError(
            f"{cls.__name__} fields {missing} have no documentation; declare each with "
            "field(metadata={'doc': 'one line'})"
        )
    return docs


def _attributes_section(docs: Mapping[str, str]) -> str:
    lines = ["", "    Attributes:"]
    for name, doc in docs.items():
        lines += textwrap.wrap(f"{name}: {doc}", 100, initial_indent=" " * 8, subsequent_indent=" " * 12)
    return "\n".join(lines) + "\n"


Event.__doc__ = (Event.__doc__ or "").rstrip() + "\n" + _attributes_section(field_docs(Event))


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


def counts_as_incident(event: Mapping[str, Any]) -> bool:
    """Whether ``event`` is counted as an incident: a root cause, not a consequence, an advisory kind (a coverage
    warning, an overflow risk), nor a batch field declared a convention of the data (``details["convention"]``).

    The one rule behind the ``numguard/incidents`` counter, the demo's summary and
    ``numguard explain``; an event without ``root_cause`` (older files) is a root cause.

    Example:
        >>> counts_as_incident({"kind": "nonfinite_loss", "root_cause": False})
        False
    """
    details = event.get("details")
    convention = isinstance(details, Mapping) and bool(details.get("convention"))  # a field declared a convention
    kind = event.get("kind")
    advisory = isinstance(kind, str) and registry.is_advisory(kind)  # a built-in or registered check's kind
    return not advisory and bool(event.get("root_cause", True)) and not convention


def validate_event(obj: Any) -> str | None:
    """What is wrong with one decoded ``events.jsonl`` line, or ``None`` when it is a valid event.

    A valid event is a JSON object with every key of :data:`REQUIRED_FIELDS`, each of its type
    (``true`` is not an int), and a ``where`` list of strings. Unknown kinds, actions and extra
    keys are accepted: files of newer versions stay readable.
    """
    if not isinstance(obj, dict):
        return f"not a JSON object (got {type(obj).__name__})"
    for key, expected in REQUIRED_FIELDS.items():
        if key not in obj:
            return f"missing required key {key!r}"
        value = obj[key]
        # bool is an int subclass, but `"step": true` is corrupt, not step 1.
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            return f"{key!r} must be {_TYPE_NAMES.get(expected, expected.__name__)}, got {type(value).__name__}"
    if not all(isinstance(name, str) for name in obj["where"]):
        return "'where' must be a list of strings"
    return None


_TYPE_NAMES = {int: "an int", str: "a string", list: "a list"}


def read_events(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Read an ``events.jsonl`` file, keeping every valid event and noting every bad line.

    The one reader of event files: a line cut short by a crash, or written by hand, costs that
    line and never the rest of the file.

    Args:
        path: the file.

    Returns:
        ``(events, problems)``: the valid events in file order, and one note per skipped line
        (``"line 4: not valid JSON (...)"``, ``"line 7: 'step' must be an int, got str"``, a
        line that is not UTF-8). Blank lines are neither.

    Raises:
        OSError: the file cannot be read.
    """
    events: list[dict[str, Any]] = []
    problems: list[str] = []
    with Path(path).open("rb") as stream:
        for line_no, raw in enumerate(stream, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.append(f"line {line_no}: not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"line {line_no}: not valid JSON ({exc.msg})")
                continue
            problem = validate_event(obj)
            if problem is None:
                events.append(obj)
            else:
                problems.append(f"line {line_no}: {problem}")
    return events, problems
