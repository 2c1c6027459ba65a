"""Explain a failed run: an ``events.jsonl`` incident report, or the likely cause in a plain log.

Pure functions, shared by ``numguard explain`` and anything else that wants the same text:

- :func:`~lightning_numguard.reporting.events.read_events` (the one reader) reads ``events.jsonl``
  leniently (corrupt lines become *problems*);
- :func:`~lightning_numguard.reporting.incidents.format_report` (re-exported here, with the summary and
  the first culprit) turns events into a readable incident report;
- :func:`~lightning_numguard.reporting.logs.explain_log` (re-exported here) matches a log or
  traceback of an unguarded run against :data:`~lightning_numguard.reporting.catalogue.CATALOGUE`;
- :func:`explain` / :func:`explain_path` decide which of the two a path is and return the
  report with its exit code.

Exit codes (also the CLI's) are :class:`ExitCode`, with their meaning in :data:`EXIT_CODE_HELP`.

Nothing here prints; the CLI does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lightning_numguard.reporting.events import read_events
from lightning_numguard.reporting.incidents import (
    EVENTS_FILENAME,
    first_culprit,
    format_report,
    step_actions,
    summarize_events,
)
from lightning_numguard.reporting.logs import Match, explain_log, format_log_report

__all__ = [
    "EVENTS_FILENAME",
    "EXIT_CODE_HELP",
    "ExitCode",
    "Explanation",
    "Match",
    "explain",
    "explain_log",
    "explain_path",
    "find_events_files",
    "first_culprit",
    "format_log_report",
    "format_report",
    "step_actions",
    "summarize_events",
]


class ExitCode(IntEnum):
    """The exit codes of ``numguard explain`` (and of the whole CLI)."""

    OK = 0
    NO_CAUSE = 1
    ERROR = 2


EXIT_CODE_HELP: Mapping[ExitCode, str] = MappingProxyType(
    {
        ExitCode.OK: "a report was written, or a known cause was found",
        ExitCode.NO_CAUSE: 'the input was read but no known cause was recognised ("no known cause")',
        ExitCode.ERROR: "usage error, or PATH missing, unreadable, binary or with nothing parseable",
    }
)
"""What each exit code means, for help texts."""

_BINARY_PROBE = 8192


@dataclass(frozen=True)
class Explanation:
    """The outcome of explaining one path.

    Attributes:
        text: the human report (or, for ``ExitCode.ERROR``, the error message).
        exit_code: the :class:`ExitCode`.
        summary: the machine-readable form (``--json``).
    """

    text: str
    exit_code: ExitCode
    summary: dict[str, Any]


def find_events_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Every ``events.jsonl`` under ``folder`` (recursively), newest first."""
    found = [path for path in Path(folder).rglob(EVENTS_FILENAME) if path.is_file()]
    return sorted(found, key=lambda path: (path.stat().st_mtime, str(path)), reverse=True)


def explain(path: str | os.PathLike[str]) -> Explanation:
    """Explain a run from its ``events.jsonl``, a folder holding one, or a plain log.

    A folder is searched recursively for ``events.jsonl`` (the newest is used and named). A
    file is an events file when it is called ``events.jsonl`` or most of its non-empty lines
    are JSON objects with a ``kind`` key; any other file is a log, matched against the
    catalogue.

    Args:
        path: the file or folder.

    Returns:
        The report, its exit code and its summary; never raises for a bad path (that is an
        ``ExitCode.ERROR`` explanation whose text names the path and the problem).
    """
    target = Path(path)
    if not target.exists():
        return _error(target, "no such file or directory")
    others: list[Path] = []
    if target.is_dir():
        try:
            candidates = find_events_files(target)
        except OSError as exc:
            return _error(target, f"cannot search the folder ({exc.strerror or exc})")
        if not candidates:
            return _error(target, f"no {EVENTS_FILENAME} found in this folder or below it")
        target, others = candidates[0], candidates[1:]
    try:
        head = _read_head(target)
    except OSError as exc:
        return _error(target, f"cannot read it ({exc.strerror or exc})")
    if b"\x00" in head:
        return _error(target, "binary file, not an events.jsonl or a text log")
    if not head.strip() and target.name != EVENTS_FILENAME:  # an empty events.jsonl: a run without incidents
        return _error(target, "empty file: there is nothing to explain")
    try:
        if target.name == EVENTS_FILENAME or _looks_like_events(target):
            return _explain_events(target, others)
        return _explain_text(target)
    except OSError as exc:
        return _error(target, f"cannot read it ({exc.strerror or exc})")


def explain_path(path: str | os.PathLike[str]) -> tuple[str, ExitCode]:
    """:func:`explain`, as ``(text, exit_code)``; with ``ExitCode.ERROR`` the text is the error message."""
    result = explain(path)
    return result.text, result.exit_code


def _error(path: Path, problem: str) -> Explanation:
    message = f"numguard explain: {path}: {problem}"
    return Explanation(message, ExitCode.ERROR, {"input": "error", "path": str(path), "error": problem})


def _read_head(path: Path) -> bytes:
    with open(path, "rb") as stream:
        return stream.read(_BINARY_PROBE)


def _looks_like_events(path: Path) -> bool:
    """Whether most non-empty lines (of the first 200) are JSON objects with a ``kind`` key."""
    seen = events = 0
    with open(path, encoding="utf-8", errors="replace") as stream:
        for line in stream:
            if not line.strip():
                continue
            seen += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            events += isinstance(obj, dict) and "kind" in obj
            if seen >= 200:
                break
    return events > 0 and 2 * events >= seen


def _explain_events(path: Path, others: Sequence[Path]) -> Explanation:
    events, problems = read_events(path)
    if not events and problems:
        listed = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        return _error(path, f"no valid event in {len(problems)} non-empty line(s): {listed}")
    summary = summarize_events(events, path, problems)
    summary["other_events_files"] = [str(other) for other in others]
    return Explanation(format_report(events, path, problems, others=others), ExitCode.OK, summary)


def _explain_text(path: Path) -> Explanation:
    with open(path, encoding="utf-8", errors="replace") as stream:
        matches = explain_log(line.rstrip("\r\n") for line in stream)
    summary: dict[str, Any] = {
        "input": "log",
        "path": str(path),
        "likely_cause": matches[0].name if matches else None,
        "matches": [match.to_dict() for match in matches],
    }
    return Explanation(format_log_report(matches, path), ExitCode.OK if matches else ExitCode.NO_CAUSE, summary)
