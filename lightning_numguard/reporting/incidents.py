"""The incidents of one run's ``events.jsonl``: its first culprit, the action of each step, a summary and a
readable report.

Pure functions over the events :func:`~lightning_numguard.reporting.events.read_events` returns (dicts, in file
order), shared by ``numguard explain`` (text and ``--json``) and anything else that wants the same text;
:mod:`lightning_numguard.reporting.explain` decides which input a path is and the exit code. Nothing here prints.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from lightning_numguard.reporting.events import ACTING_ACTIONS, ACTIONS, REQUIRED_FIELDS, counts_as_incident
from lightning_numguard.reporting.hints import event_hint, kind_hint, op_hint
from lightning_numguard.reporting.logs import wrap
from lightning_numguard.reporting.messages import steps_words

__all__ = ["EVENTS_FILENAME", "first_culprit", "format_report", "step_actions", "summarize_events"]

EVENTS_FILENAME = "events.jsonl"

_SHOWN_EXTRAS = ("time", "details", "replay")
_MAX_WHERE = 48

Event = dict[str, Any]

#: Actions that turn a step into a no-op (the summary's "steps skipped" counts them).
_STEP_SKIPPED = ACTING_ACTIONS


def _is_note(event: Event) -> bool:
    """A warning that is no incident: an optimizer coverage problem, a batch field declared a convention."""
    details = event.get("details")
    return event.get("kind") == "optimizer_coverage" or (
        isinstance(details, Mapping) and bool(details.get("convention"))
    )


def first_culprit(events: Sequence[Event]) -> Event | None:
    """The root cause: the first recorded incident event of the earliest step with one.

    Events of one step are recorded in causal order (inputs, parameters, module outputs, ops,
    loss, gradients), so the first one of the earliest step is where the trouble began. A
    warning that is no incident (an optimizer coverage problem found at step 0) is never the
    culprit of a later NaN; it is the culprit only of a file that holds nothing else.
    """
    if not events:
        return None
    incidents = [event for event in events if not _is_note(event)] or list(events)
    earliest = min(event["step"] for event in incidents)
    return next(event for event in incidents if event["step"] == earliest)


def step_actions(events: Sequence[Event]) -> dict[int, str]:
    """The action taken at each step that had one (``warn``, ``skip``, ``rollback``, ``halt``, ...).

    Every event of a step carries the step's one action, so actions are counted per step, as the
    callback's counters count them, never per event. The end-of-fit repair (``details["when"] ==
    "end of training"``) is keyed apart from the steps (as ``-1 - step``): it restores but skips nothing.
    """
    actions: dict[int, str] = {}
    for event in events:
        action = event.get("action")
        if action == "none" or not isinstance(action, str):
            continue
        details = event.get("details")
        at_end = isinstance(details, Mapping) and details.get("when") == "end of training"
        actions.setdefault(-1 - int(event["step"]) if at_end else int(event["step"]), action)
    return actions


def summarize_events(
    events: Sequence[Event], source: str | os.PathLike[str], problems: Sequence[str] = ()
) -> dict[str, Any]:
    """A machine-readable summary of an incident file (what ``numguard explain --json`` prints).

    Args:
        events: the valid events, in file order.
        source: the ``events.jsonl`` they came from.
        problems: the notes on skipped lines, from :func:`~lightning_numguard.reporting.events.read_events`.

    Returns:
        A JSON-serialisable dict: ``events_file``, ``incidents`` (root causes, counted like the
        ``numguard/incidents`` counter: consequences and coverage warnings are listed, not counted),
        ``events`` (every event), ``consequences``, ``warnings`` (coverage problems, fields declared
        conventions), ``steps`` (sorted distinct steps with an incident), ``first_step``/``last_step``,
        ``ranks``, ``kinds`` (events per kind), ``actions`` (steps per action, as the callback counts
        them), ``skipped_steps`` and ``rollbacks`` (as the end-of-fit summary counts them),
        ``first_culprit`` (the event, with its ``hint``), ``hints`` (per kind present) and
        ``skipped_lines``.
    """
    steps = sorted({event["step"] for event in events if not _is_note(event)})
    kinds = Counter(event["kind"] for event in events)
    culprit = first_culprit(events)
    actions = step_actions(events)
    return {
        "input": "events",
        "events_file": str(source),
        "incidents": sum(1 for event in events if counts_as_incident(event)),
        "events": len(events),
        "consequences": sum(1 for event in events if event.get("root_cause", True) is False),
        "warnings": sum(1 for event in events if _is_note(event)),
        "steps": steps,
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "ranks": sorted({event["rank"] for event in events}),
        "kinds": dict(kinds),
        "actions": _action_counts(actions),
        "skipped_steps": sum(1 for step, action in actions.items() if step >= 0 and action in _STEP_SKIPPED),
        "rollbacks": sum(1 for action in actions.values() if action == "rollback"),
        "first_culprit": None if culprit is None else {**culprit, "hint": _event_hint(culprit)},
        "hints": {kind: kind_hint(kind) for kind in kinds},
        "skipped_lines": list(problems),
    }


def _action_counts(actions: Mapping[int, str]) -> dict[str, int]:
    counts = Counter(actions.values())
    # The four actions always appear (a zero says something too); unknown ones when used.
    shown = [action for action in ACTIONS if action != "none"]
    shown += sorted(action for action in counts if action not in ACTIONS)
    return {action: counts[action] for action in shown}


def _replay(event: Event) -> Any:
    """The event's ``replay`` record: top level, or inside ``details`` as the callback may nest it."""
    details = event.get("details")
    if "replay" not in event and isinstance(details, Mapping):
        return details.get("replay")
    return event.get("replay")


def _event_hint(event: Event) -> str:
    """:func:`~lightning_numguard.reporting.hints.event_hint`, the live message's advice; an
    autograd op's hint is labelled with the op."""
    details = event.get("details")
    details = dict(details) if isinstance(details, Mapping) else {}
    replay = _replay(event)
    if isinstance(replay, Mapping):
        details["replay"] = replay
    hint = event_hint(event["kind"], details)
    op = replay.get("op") if isinstance(replay, Mapping) else None
    if isinstance(op, str) and hint == op_hint(op):
        return f"{op}: {hint}"
    return hint


def format_report(
    events: Sequence[Event],
    source: str | os.PathLike[str],
    problems: Sequence[str] = (),
    *,
    others: Sequence[str | os.PathLike[str]] = (),
) -> str:
    """A readable incident report of the events of one run.

    Args:
        events: the valid events, in file order (as
            :func:`~lightning_numguard.reporting.events.read_events` returns them).
        source: the ``events.jsonl`` they came from, named in the header.
        problems: the notes on skipped lines, listed under the header.
        others: other ``events.jsonl`` files that were found but not used (older ones in the
            same folder), listed under the file name.

    Returns:
        The report: header (file, incidents, steps, ranks), the first culprit with its message
        and hint, a timeline (one line per event, extras indented below), the actions taken and
        one hint per kind. ``"no incidents recorded"`` when there are no events.
    """
    lines = ["numguard incident report", f"  file:       {source}"]
    if others:
        lines.append(f"              (the newest of {len(others) + 1} {EVENTS_FILENAME} files; not used:)")
        lines.extend(f"              {other}" for other in others)
    if problems:
        lines.append(f"  skipped:    {len(problems)} corrupt line(s)")
        lines.extend(f"              {problem}" for problem in problems)
    if not events:
        lines += ["", "no incidents recorded"]
        return "\n".join(lines)

    summary = summarize_events(events, source, problems)
    steps: list[int] = summary["steps"]
    if steps:
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        counted = f"{summary['incidents']} in {len(steps)} step(s) ({span})"
    else:
        counted = "none"
    parts = [f"{summary['consequences']} consequence(s)"] if summary["consequences"] else []
    parts += [f"{summary['warnings']} warning(s)"] if summary["warnings"] else []
    if parts:
        counted += f"; {summary['events']} events, of them {' and '.join(parts)}"
    lines.append(f"  incidents:  {counted}")
    lines.append(f"  ranks:      {', '.join(map(str, summary['ranks']))}")

    culprit = first_culprit(events)
    assert culprit is not None  # events is not empty
    shown: set[str] = set()  # replay blocks already printed: the events of one step share theirs
    lines += [
        "",
        f"First culprit: {culprit['kind']} at {_where(culprit, limit=None)}",
        f"  step {culprit['step']}, epoch {culprit['epoch']}, batch {culprit['batch_idx']}, "
        f"rank {culprit['rank']}; action: {culprit['action']}",
        wrap("  message: ", culprit["message"]),
        *_extras(culprit, indent="  ", shown=shown),
        wrap("  hint:    ", _event_hint(culprit)),
        "",
        "Timeline (in recorded order; '>' marks the first culprit)",
    ]
    header = ("step", "epoch/batch", "rank", "kind", "where", "action")
    rows = [
        (
            str(event["step"]),
            f"{event['epoch']}/{event['batch_idx']}",
            str(event["rank"]),
            event["kind"],
            _where(event, limit=_MAX_WHERE),
            event["action"],
        )
        for event in events
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines.append("    " + _columns(header, widths))
    for group, repeats in _step_groups(events):
        for event in group:
            marker = "  > " if event is culprit else "    "
            lines.append(marker + _columns(rows[_index(events, event)], widths))
            lines.extend(_extras(event, indent="        ", shown=shown))
        if repeats:
            lines.append(_repeat_line(group, repeats))

    counts = ", ".join(f"{action} {count}" for action, count in summary["actions"].items())
    skipped = summary["skipped_steps"]
    lines += ["", f"Actions taken: {counts} (one per step; {skipped} step update(s) dropped in all)", ""]
    lines += _hint_lines(events)
    return "\n".join(lines)


def _index(events: Sequence[Event], event: Event) -> int:
    return next(i for i, e in enumerate(events) if e is event)


def _signature(group: Sequence[Event]) -> tuple[Any, ...]:
    """What makes two steps' events the same story: each event's kind, place, action and role, in order."""
    return tuple((e["kind"], tuple(e["where"]), e["action"], e.get("root_cause", True)) for e in group)


def _step_groups(events: Sequence[Event]) -> list[tuple[list[Event], list[Event]]]:
    """The events of each step, in recorded order, each with the later steps that repeated it exactly (their
    events are folded into one line under it)."""
    steps: list[list[Event]] = []
    for event in events:
        if steps and steps[-1][0]["step"] == event["step"]:
            steps[-1].append(event)
        else:
            steps.append([event])
    out: list[tuple[list[Event], list[Event]]] = []
    for group in steps:
        if out and _signature(out[-1][0]) == _signature(group):
            out[-1][1].append(group[0])
        else:
            out.append((group, []))
    return out


def _repeat_line(group: Sequence[Event], repeats: Sequence[Event]) -> str:
    """The line standing for the steps that repeated ``group`` exactly."""
    steps = [int(e["step"]) for e in repeats]
    events = f"{len(group)} events" if len(group) > 1 else "event"
    first = group[0]
    plural = "s" if len(steps) > 1 else ""
    same = f"the same {events} as step {first['step']}, action {first['action']}"
    return f"    ... step{plural} {steps_words(steps)}: {same}"


def _hint_lines(events: Sequence[Event]) -> list[str]:
    """One hint per root cause (its kind at its place), the most specific known; a consequence gets none (it
    follows from its root cause), nor does a warning that no incident came with."""
    roots = [e for e in events if counts_as_incident(e)] or [
        e for e in events if e.get("root_cause", True) is not False
    ]
    causes: dict[tuple[str, str], list[Event]] = {}
    for event in roots:
        causes.setdefault((event["kind"], event["where"][0] if event["where"] else ""), []).append(event)
    lines = ["Hints (one per root cause; consequences follow from it)"]
    for (kind, where), found in causes.items():
        label = f"{kind} in {where}" if where else kind
        lines.append(wrap(f"  {label} ({len(found)}): ", _event_hint(found[0]), indent="    "))
    return lines


def _columns(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()


def _where(event: Event, *, limit: int | None) -> str:
    text = ", ".join(event["where"]) or "-"
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


#: Details a consequence shares with its root cause's event (shown there once).
_SHARED_DETAILS = ("checked", "steps_lost", "snapshot_step", "after", "replay")


def _extras(event: Event, *, indent: str, shown: set[str] | None = None) -> list[str]:
    """Lines for the optional keys of an event that hold something: time, details, replay (once per run of
    ``shown``), then any other key; a ``null`` field and the default ``root_cause: true`` are left out. A
    consequence gets one line: what it followed, and what is its own."""
    if event.get("root_cause", True) is False:
        return _consequence_extras(event, indent)
    lines: list[str] = []
    if "time" in event:
        lines.append(f"{indent}time:    {_format_time(event['time'])}")
    details = event.get("details")
    replay = _replay(event)
    if isinstance(details, Mapping):
        details = {key: value for key, value in details.items() if value is not replay}
    if isinstance(details, Mapping) and details:
        lines.append(f"{indent}details: {_key_values(details)}")
    elif details not in (None, {}):
        lines.append(f"{indent}details: {_scalar(details)}")
    if _shown_before(replay, shown):
        replay = None
    if isinstance(replay, Mapping) and replay:
        lines.append(f"{indent}replay:  {_replay_words(replay, event.get('module'))}")
    elif replay not in (None, {}):
        lines.append(f"{indent}replay:  {_scalar(replay)}")
    for key in sorted(set(event) - set(REQUIRED_FIELDS) - set(_SHOWN_EXTRAS)):
        if event[key] is None or (key == "root_cause" and event[key] is True):
            continue
        value = _scalar(event[key])
        if key == "module" and event.get("op"):
            value += " (the module that ran the op)"
        lines.append(f"{indent}{key}: {value}")
    return lines


def _shown_before(replay: Any, shown: set[str] | None) -> bool:
    """Whether this replay record was printed already (a step's events share theirs); noted in ``shown``."""
    if not isinstance(replay, Mapping) or not replay or shown is None:
        return False
    key = json.dumps(replay, sort_keys=True, default=str)
    seen = key in shown
    shown.add(key)
    return seen


def _replay_words(replay: Mapping[str, Any], module: Any) -> str:
    """The replay's record, its two modules told apart: the one that ran the op, and the first module output the
    value reached (``forward_module``: the same module, or one that only received it)."""
    parts = [f"module {replay['module']}"] if "module" in replay else []
    parts += [f"op {replay['op']}"] if "op" in replay else []
    first = replay.get("forward_module")
    if isinstance(first, str):
        ran = replay.get("op_module") or replay.get("module") or module
        role = "the module that made it" if first == ran else f"which only received it{f' from {ran}' if ran else ''}"
        parts.append(f"first module output holding it: {first} ({role})")
    rest = {key: value for key, value in replay.items() if key not in ("module", "op", "forward_module")}
    parts += [_key_values(rest)] if rest else []
    return ", ".join(parts)


def _consequence_extras(event: Event, indent: str) -> list[str]:
    """A consequence in one line: the root cause it followed (not counted), and its own details."""
    details = event.get("details")
    details = details if isinstance(details, Mapping) else {}
    after = details.get("after") or event.get("consequence_of") or "the step's root cause"
    own = {key: value for key, value in details.items() if key not in _SHARED_DETAILS and value not in ([], {})}
    return [f"{indent}consequence of {after} (not counted)" + (f"; {_key_values(own)}" if own else "")]


def _format_time(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, tz=timezone.utc).isoformat(timespec="seconds")
        except (OverflowError, OSError, ValueError):
            return str(value)
    return str(value)


def _key_values(mapping: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={_scalar(value)}" for key, value in mapping.items() if value is not None)


def _scalar(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)
