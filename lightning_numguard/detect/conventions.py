"""A batch field flagged on step after step: a deliberate mask is a convention of the data, anything else a broken
pipeline.

A field that holds infinities in *every* batch as a mask (``-inf`` padding the model masks out itself) would have
the guard skip or roll back every step: the run would make no progress, quietly. After :data:`CONVENTION_STEPS`
consecutive checked steps with the same field flagged, that field is declared a convention **only when its flagged
values are masks**: infinities and no NaN (a value equal to its dtype's own finite extreme, ``finfo.min``, is a mask
already and never flagged). One event (action ``"none"``) and one warning name it and the setting that silences
it, and the field is no longer checked in this fit. The loss, the module outputs, the gradients and the weights are
still checked every step, so a convention that does poison the step is still caught there.

Anything else flagged on those consecutive steps (a known fill sentinel such as numpy's masked-array 1e20 or
netCDF's 9.96921e36, another huge finite value, NaN) is a broken data pipeline, not a convention: the finding gets
``details["persistent"]`` and the step halts (``NonFiniteError``) with the fix, instead of the guard accepting the
values or skipping every step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_numguard.diagnose.findings import Finding, mark_consequences

__all__ = ["CONVENTION_STEPS", "INPUT_KINDS", "InputConventions", "is_mask"]

#: Consecutive checked steps with the same batch field flagged that make it a convention of the data.
CONVENTION_STEPS = 3
#: The kinds that name a batch field.
INPUT_KINDS = ("nonfinite_input", "suspicious_input")


class InputConventions:
    """Counts, per batch field, the consecutive steps it was flagged in; declares a convention at ``steps``.

    Args:
        steps: consecutive flagged steps that make a field a convention.

    Attributes:
        ignored: the fields declared conventions in this fit (the step inspector leaves them out of its checks).
    """

    def __init__(self, steps: int = CONVENTION_STEPS) -> None:
        self.steps = steps
        self.runs: dict[str, int] = {}
        self.ignored: set[str] = set()

    def clean_step(self) -> None:
        """A checked step with no input flagged: every run of flagged steps ends."""
        self.runs.clear()

    def sort(self, findings: list[Finding]) -> tuple[list[Finding], list[Finding]]:
        """Split a hit's ``findings`` into those still acted on and the conventions declared at this step.

        A declared finding (a mask: :func:`is_mask`) keeps its kind and gets ``details["convention"]`` (the number
        of steps); its fields are added to :attr:`ignored`. A field flagged as long with anything else stays acted
        on, its finding marked ``details["persistent"]`` (the step then halts). Fields of other findings are not
        touched.
        """
        flagged = {p for f in findings if f.kind in INPUT_KINDS for p in f.where if p not in self.ignored}
        self.runs = {p: self.runs.get(p, 0) + 1 for p in flagged}
        due = {p for p, n in self.runs.items() if n >= self.steps}
        masks = {p for f in findings if is_mask(f) for p in f.where}
        new = due & masks
        persistent = due - masks  # a fill value, a huge value or NaN in every batch: the data pipeline is broken
        if persistent:
            findings = [
                replace(f, details={**f.details, "persistent": {"steps": self.runs[next(iter(hit))]}})
                if f.kind in INPUT_KINDS and (hit := persistent.intersection(f.where))
                else f
                for f in findings
            ]
        if not new:
            return findings, []
        acted: list[Finding] = []
        declared: list[Finding] = []
        for f in findings:
            if f.kind not in INPUT_KINDS or not new.intersection(f.where):
                acted.append(f)
                continue
            fields = [p for p in f.where if p in new]
            details = {**f.details, "convention": {"steps": self.steps}}
            declared.append(replace(f, where=fields, details=details))
            rest = [p for p in f.where if p not in new]
            if rest:
                acted.append(replace(f, where=rest))
        for p in new:
            del self.runs[p]
        self.ignored |= new
        # what remains is judged on its own: its first finding is the step's root cause
        acted = [replace(f, root_cause=True, consequence_of=None, details=_without_after(f.details)) for f in acted]
        return mark_consequences(acted), declared


def is_mask(finding: Finding) -> bool:
    """Whether a batch finding's flagged values are deliberate masks: infinities, and no NaN among them."""
    stats = finding.details.get("stats") or {}
    infinities = int(stats.get("posinf", 0)) + int(stats.get("neginf", 0))
    return finding.kind == "nonfinite_input" and infinities > 0 and not int(stats.get("nan", 0))


def _without_after(details: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in details.items() if k != "after"}
