"""What a step's read found: :class:`Finding`, their causal order, and the marking of consequences.

One bad value usually makes several findings in one step (a NaN input makes the outputs, the
loss and the gradients non-finite). They are kept in the order they happen in a step, so the
first one is the root cause; each later one is marked as its consequence.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .events import KINDS

__all__ = ["AFTER_FORWARD", "Finding", "causal_position", "mark_consequences", "merge"]

#: ``details["when"]`` of buffers found bad after the forward pass (BatchNorm running stats).
AFTER_FORWARD = "after the forward pass"


@dataclass
class Finding:
    """One thing found non-finite (or out of domain) in a step, on one rank.

    Attributes:
        kind: an incident kind from :data:`~lightning_numguard.core.events.KINDS`.
        where: names of what went bad (batch paths, module, parameter or op names).
        details: the numbers behind it (counts, max-|x|, the replay's result…).
        rank: the global rank that saw it (``-1`` when the rank is not known).
    """

    kind: str
    where: list[str]
    details: dict[str, Any] = field(default_factory=dict)
    rank: int = -1

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        """What makes two ranks' findings the same finding."""
        return self.kind, tuple(self.where)


def causal_position(finding: Finding) -> int:
    """Where in a step ``finding`` happens: the index of its kind in ``KINDS``.

    Buffers poisoned by the forward pass come after everything else; unknown kinds last.
    """
    if finding.kind == "nonfinite_param" and finding.details.get("when") == AFTER_FORWARD:
        return len(KINDS)
    return KINDS.index(finding.kind) if finding.kind in KINDS else len(KINDS) + 1


def merge(parts: Iterable[Iterable[Finding]]) -> list[Finding]:
    """Every rank's findings as one list: duplicates dropped, in causal order, then by rank.

    Each rank appended its own in causal order; the sort is stable, so findings of the same kind
    keep that order (e.g. module outputs in execution order).
    """
    merged: list[Finding] = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for part in parts:
        for finding in part:
            if finding.key not in seen:
                seen.add(finding.key)
                merged.append(finding)
    merged.sort(key=lambda f: (causal_position(f), f.rank))
    return merged


def mark_consequences(findings: list[Finding]) -> None:
    """Tell every finding after the first (the root cause) what that cause was (``details["after"]``)."""
    if len(findings) < 2:
        return
    root = findings[0]
    cause = f"{root.kind} in `{root.where[0]}`" if root.where else root.kind
    for finding in findings[1:]:
        finding.details.setdefault("after", cause)
