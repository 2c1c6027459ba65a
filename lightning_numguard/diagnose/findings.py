"""What a step's read found: :class:`Finding`, their causal order, and the marking of consequences.

One bad value usually makes several findings in one step (a NaN input makes the outputs, the
loss and the gradients non-finite). They are kept in the order they happen in a step, so the
first one is the root cause; each later one is marked as its consequence.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_numguard.detect import registry

__all__ = ["AFTER_FORWARD", "Finding", "causal_position", "mark_consequences", "merge"]

#: ``details["when"]`` of buffers found bad after the forward pass (BatchNorm running stats).
AFTER_FORWARD = "after the forward pass"


@dataclass(frozen=True)
class Finding:
    """One thing found non-finite (or out of domain) in a step, on one rank. Immutable: a changed finding is a new
    one (``dataclasses.replace``).

    Attributes:
        kind: an incident kind from :data:`~lightning_numguard.reporting.events.KINDS`, or a registered check's.
        where: names of what went bad (batch paths, module, parameter or op names).
        details: the numbers behind it (counts, max-|x|, the replay's result…).
        rank: the global rank that saw it (``-1`` when the rank is not known).
        op: the op that made it (a forward op such as ``div``, or an autograd node such as
            ``SqrtBackward0``), when the replay or the op guard named one.
        module: the module that op ran in, when known.
        site: for ``nonfinite_param``: ``"param"``, ``"buffer"`` or ``"optimizer_state"``.
        source: ``"file:line"`` of the user's code that ran the op.
        root_cause: ``False`` for a consequence of an earlier finding of the same step.
        consequence_of: the kind of the step's root cause, for a consequence.
    """

    kind: str
    where: list[str]
    details: dict[str, Any] = field(default_factory=dict)
    rank: int = -1
    op: str | None = None
    module: str | None = None
    site: str | None = None
    source: str | None = None
    root_cause: bool = True
    consequence_of: str | None = None

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        """What makes two ranks' findings the same finding."""
        return self.kind, tuple(self.where)


def causal_position(finding: Finding) -> int:
    """Where in a step ``finding`` happens, the one causal order: the index of its kind in the checks' declared
    order (``detect/registry``: the built-in kinds, ``KINDS``, with every registered check at its place).

    Buffers poisoned by the forward pass come after everything else; unknown kinds last.
    """
    order = registry.kinds(registry.known())
    if finding.kind == "nonfinite_param" and finding.details.get("when") == AFTER_FORWARD:
        return len(order)
    return order.index(finding.kind) if finding.kind in order else len(order) + 1


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
    # a finding whose values came from another rank through a collective (tensor parallel) follows its source
    merged.sort(
        key=lambda f: (causal_position(f), bool((f.details.get("replay") or {}).get("from_another_rank")), f.rank)
    )
    return merged


def mark_consequences(findings: list[Finding]) -> list[Finding]:
    """``findings`` with every one after the first (the root cause) marked as its consequence.

    A consequence has ``root_cause=False``, ``consequence_of`` (the root's kind) and ``details["after"]`` (the
    root's kind and first name, for the hint). Advisory findings (optimizer coverage, overflow risks) are
    never incidents: they are neither a root cause nor a consequence of one.
    """
    incidents = [f for f in findings if not registry.is_advisory(f.kind)]
    if len(incidents) < 2:
        return list(findings)
    root = incidents[0]
    cause = f"{root.kind} in `{root.where[0]}`" if root.where else root.kind
    later = {id(f) for f in incidents[1:]}
    return [
        replace(
            f, root_cause=False, consequence_of=root.kind, details={**f.details, "after": f.details.get("after", cause)}
        )
        if id(f) in later
        else f
        for f in findings
    ]
