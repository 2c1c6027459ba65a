"""The likely cause of a failure in a plain log or traceback of an unguarded run.

:func:`explain_log` matches the text against :data:`~lightning_numguard.reporting.catalogue.CATALOGUE`;
:func:`format_log_report` turns the matches into the report ``numguard explain LOG`` prints.
"""

from __future__ import annotations

import os
import string
import textwrap
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_numguard.reporting.anomaly import (
    ForwardCall,
    ForwardTraces,
    NodeReading,
    backward_only,
    guard_reading,
    read_node,
)
from lightning_numguard.reporting.catalogue import ASSERTION, CATALOGUE, DEVICE_ASSERT_OPS, Pattern
from lightning_numguard.reporting.hints import kind_hint, op_hint

__all__ = ["Match", "explain_log", "format_log_report", "wrap"]

_MAX_QUOTE = 240
ANOMALY = "anomaly_nan_in_backward"
_ABOVE = "(anomaly mode prints its forward traceback just above)"
WIDTH = 100


def wrap(label: str, text: str, *, indent: str | None = None) -> str:
    """``label`` + ``text``, wrapped at :data:`WIDTH` with continuation lines aligned under the text."""
    subsequent = " " * len(label) if indent is None else indent
    return textwrap.fill(text, WIDTH, initial_indent=label, subsequent_indent=subsequent, break_on_hyphens=False)


@dataclass(frozen=True)
class Match:
    """One catalogue entry found in a log.

    Attributes:
        pattern: the catalogue entry.
        line_no: the 1-based number of the first line it matched.
        line: that line, stripped (and shortened when very long).
        count: how many lines it matched in all.
        groups: the named groups of the first match (``op`` for anomaly mode, ...).
        forward: for anomaly mode, the forward call behind the node, read from the log's "Traceback of forward
            call that caused the error" (``None`` when the log holds none).
    """

    pattern: Pattern
    line_no: int
    line: str
    count: int = 1
    groups: Mapping[str, str] = field(default_factory=dict)
    forward: ForwardCall | None = None

    @property
    def name(self) -> str:
        """The catalogue entry's name."""
        return self.pattern.name

    @property
    def reading(self) -> NodeReading | None:
        """For anomaly mode, which node made the value (:func:`~lightning_numguard.reporting.anomaly.read_node`)."""
        return read_node(self.groups["op"], self.forward) if self._anomaly else None

    @property
    def cause(self) -> str:
        """The likely cause, with the matched details (op, parameter, ...) filled in."""
        cause = _fill(self.pattern.cause, self.groups)
        reading = self.reading
        if reading is not None and reading.relayed:
            made = f"made by {reading.maker}" if reading.maker else "made after it in the forward pass"
            return f"{cause} It only turned into NaN an Inf {made} (anomaly mode checks for NaN only)."
        if self.groups.get("seen_in") == "traceback":
            return (
                "The device-side assert's traceback ends in this call, and its CUDA kernel asserts on bad inputs "
                f"(the log holds no 'Assertion ... failed' line to say more): {cause}"
            )
        return cause

    @property
    def fix(self) -> str:
        """The fix, with an op-specific hint when the match names a known op."""
        call, reading = self.forward, self.reading
        node = reading.maker if reading is not None and reading.relayed else self.groups.get("op")
        fix = _fill(self.pattern.fix, {**self.groups, "op": node} if node else self.groups)
        if call is not None and reading is not None and reading.relayed and node is None:
            fix = (
                f"Look after `{call.op}` at {call.file}:{call.line} for a sqrt, rsqrt or acos/asin/atanh at the edge "
                "of its domain (0, ±1), whose gradient is infinite there: add an eps inside the root, or clamp to "
                "±(1 - eps); NumGuardCallback names the node and its line."
            )
        elif call is not None and (backward_only(self.groups.get("op", "")) or node != self.groups.get("op")):
            fix = fix.replace(_ABOVE, f"(its forward call: {call.file}:{call.line})")
        elif call is not None:
            fix = (
                f"The values reaching `{call.op}` at {call.file}:{call.line} were already NaN in the forward pass: "
                "the op that first made them (this call or one upstream) is the fault, and the guard names it."
            )
        specific = op_hint(node) if node else None
        return fix if specific is None else f"{specific} {fix}"

    @property
    def _anomaly(self) -> bool:
        return self.pattern.name == ANOMALY and "op" in self.groups

    @property
    def guard_kind(self) -> str:
        """The kind ``NumGuardCallback`` records this failure under (for anomaly mode, read from the node and
        its forward call: a forward fault is ``nonfinite_output``/``nonfinite_loss``, not ``nonfinite_grad``)."""
        return guard_reading(self.groups["op"], self.forward)[0] if self._anomaly else self.pattern.hint_kind

    @property
    def guard(self) -> str:
        """What ``NumGuardCallback`` records for this failure, in one sentence."""
        if self._anomaly:
            return guard_reading(self.groups["op"], self.forward)[1]
        return f"NumGuardCallback records this as {self.guard_kind}: {kind_hint(self.guard_kind)}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view, for ``--json``."""
        return {
            "name": self.name,
            "line_no": self.line_no,
            "line": self.line,
            "count": self.count,
            "groups": dict(self.groups),
            "cause": self.cause,
            "fix": self.fix,
            "hint_kind": self.guard_kind,
            "guard": self.guard,
            "forward": None if self.forward is None else asdict(self.forward),
            "made_by": None if self.reading is None else self.reading.maker,
            "follow_on": self.pattern.follow_on,
        }


class _Keep(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _fill(template: str, groups: Mapping[str, str]) -> str:
    return string.Formatter().vformat(template, (), _Keep(groups))


def explain_log(text: str | Iterable[str], catalogue: Sequence[Pattern] = CATALOGUE) -> list[Match]:
    """Find every known failure signature in a log or traceback.

    Each line is attributed to the first catalogue entry that matches it (the catalogue is in
    severity order, most specific first). Every entry found is reported once, at its first line.

    Args:
        text: the log, as one string or as lines.
        catalogue: the entries to look for.

    Returns:
        The matches ordered by the line where each first appears, follow-on errors (cuBLAS,
        cuDNN, a generic device-side assert) after every real cause: the first match is the
        likely root cause. Empty when nothing is recognised.

    Example:
        >>> [m.name for m in explain_log("RuntimeError: all elements of input should be between 0 and 1")]
        ['bce_input_range']
    """
    lines = text.splitlines() if isinstance(text, str) else text
    first: dict[str, Match] = {}
    counts: Counter[str] = Counter()
    assertion = False  # an "Assertion ... failed" line is in the log
    op_line: tuple[int, str, str] | None = None  # the last line naming an op that device-asserts, before an assert
    asserted = False  # a "device-side assert triggered" was seen
    traces = ForwardTraces()  # anomaly mode's forward tracebacks
    for line_no, line in enumerate(lines, start=1):
        traces.feed(line)
        assertion = assertion or ASSERTION.search(line) is not None
        if "device-side assert triggered" in line:
            asserted = True
        elif not asserted:
            named = next((name for regex, name in DEVICE_ASSERT_OPS if regex.search(line)), None)
            op_line = (line_no, line, named) if named else op_line
        for pattern in catalogue:
            found = pattern.regex.search(line)
            if found is None:
                continue
            counts[pattern.name] += 1
            if pattern.name not in first:
                groups = {key: value for key, value in found.groupdict().items() if value is not None}
                first[pattern.name] = Match(pattern, line_no, _quote(line), 1, groups)
            break
    if not assertion:  # no follow-on error may send the reader to a line that is not there
        for name, match in first.items():
            if match.pattern.fix_without_assertion:
                pattern = replace(match.pattern, fix=match.pattern.fix_without_assertion)
                first[name] = replace(match, pattern=pattern)
        by_name = {pattern.name: pattern for pattern in catalogue}
        if asserted and op_line is not None and op_line[2] in by_name and op_line[2] not in first:
            # the traceback ends in an op whose kernel asserts on bad inputs: that op's entry is the likely cause
            line_no, line, name = op_line
            counts[name] = 1
            first[name] = Match(by_name[name], line_no, _quote(line), 1, {"seen_in": "traceback"})
    matches = [
        replace(match, count=counts[name], forward=traces.last(match.groups.get("op")) if name == ANOMALY else None)
        for name, match in first.items()
    ]
    return sorted(matches, key=lambda match: (match.pattern.follow_on, match.line_no))


def _quote(line: str) -> str:
    line = line.strip()
    return line if len(line) <= _MAX_QUOTE else line[: _MAX_QUOTE - 3] + "..."


def format_log_report(matches: Sequence[Match], source: str | os.PathLike[str]) -> str:
    """A readable report of the matches :func:`explain_log` found in ``source``.

    Returns:
        The likely cause first (quoted line, cause, fix, the guard's incident kind), then every
        other match in order; ``"no known cause found in SOURCE"`` when there is none.
    """
    if not matches:
        return f"no known cause found in {source}"
    lines = [f"numguard explain: {source}", ""]
    for index, match in enumerate(matches):
        title = "Likely cause:" if index == 0 else f"{index + 1}."
        if index == 1:
            lines += ["Also found (in order of first appearance):", ""]
        times = f", {match.count} matching lines" if match.count > 1 else ""
        call = match.forward
        forward = [] if call is None else [wrap("  forward call: ", f"{call.file}:{call.line}, op `{call.op}`")]
        forward += [f"    {call.code}"] if call is not None and call.code else []
        lines += [
            f"{title} {match.name} (line {match.line_no}{times})",
            f"  > {match.line}",
            wrap("  cause: ", match.cause),
            *forward,
            wrap("  fix:   ", match.fix),
            wrap("  guard: ", match.guard),
            "",
        ]
    return "\n".join(lines).rstrip()
