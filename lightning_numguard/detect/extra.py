"""The checks passed as ``NumGuardCallback(extra_checks=[...])``: recorded, folded into the step's one read, named.

A :class:`~lightning_numguard.detect.registry.Check` that is not built in declares everything about itself in one
file; this module is what the step's parts call for every such check, so none of them names one:

* :func:`record`: at the check's hook (:attr:`Check.records_at`), its 0-d device value, combined over the
  micro-batches of an accumulation window (``max`` of a ``"positive"`` value, the sum of a ``"nonfinite"`` one);
* :func:`slot_values`: one value per check, in the order of the fit's checks, after the flag slots of the step's
  packed vector (:mod:`~lightning_numguard.detect.flags`); :func:`seen_raw` decides one process's raw values on the
  host, :func:`as_flags` turns them into 0/1 flags for the reduce across ranks;
* :func:`findings`: after a hit, each seen check's findings (read late, when its records are gone: its
  placeholder).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from lightning_numguard.detect import flags
from lightning_numguard.detect.registry import Check, CheckStep
from lightning_numguard.diagnose.findings import Finding
from lightning_numguard.errors import NumGuardConfigError

__all__ = ["as_flags", "findings", "record", "seen_raw", "slot_values"]


def record(
    checks: Sequence[Check], hook: str, step: CheckStep, recorded: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``recorded`` (by kind) with the value of each check of ``hook`` for ``step`` folded in; no host read."""
    values = dict(recorded)
    for check in checks:
        if check.records_at != hook:
            continue
        value = check.record(step if hook != "batch_start" else replace(step, loss=None))
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise NumGuardConfigError(
                f"{type(check).__name__}.record must return a one-element tensor (or None), got {value!r}"
            )
        value = value.detach().reshape(())  # a view: no kernel
        if value.dtype not in (torch.float32, torch.bool):  # the packed stack takes these as they are
            value = value.to(torch.float32)
        old = values.get(check.kind)
        if old is None:
            values[check.kind] = value
        else:  # a further micro-batch of the window
            values[check.kind] = old + value if check.seen_when == "nonfinite" else torch.maximum(old, value)
    return values


def slot_values(
    checks: Sequence[Check], values: dict[str, torch.Tensor], device: torch.device, zero: torch.Tensor
) -> list[torch.Tensor]:
    """One 0-d value per check on ``device``, float32 or bool (``zero`` for a check that recorded nothing this step)."""
    return [values[c.kind].to(device) if c.kind in values else zero for c in checks]


def seen_raw(checks: Sequence[Check], raw: Sequence[float]) -> tuple[int, ...]:
    """One process's host-read values: rank 0 for a check whose value is seen, ``-1`` otherwise."""
    return tuple(0 if _seen(c, v) else -1 for c, v in zip(checks, raw))


def as_flags(checks: Sequence[Check], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The values as 0/1 flags (on the device) for a reduce across ranks that keeps the lowest rank that saw each."""
    return [(~v.isfinite() if c.seen_when == "nonfinite" else v > 0).to(torch.float32) for c, v in zip(checks, values)]


def findings(
    checks: Sequence[Check],
    seen: flags.StepFlags,
    step: CheckStep | None,
    recorded: dict[str, torch.Tensor],
    rank: int,
    world: int,
    late: bool,
) -> list[Finding]:
    """The findings of every check seen in this read, on this rank (``late``, or no step to look at: its
    placeholder, with the lowest rank that saw it). A rank asks a check for its findings only where its own
    ``recorded`` value was seen (a host read, after a hit only); the gather keeps every rank's."""
    out: list[Finding] = []
    for i, check in enumerate(checks):
        slot = len(flags.SLOTS) + i
        if not seen.seen_on(slot, rank, world):
            continue
        if late or step is None:
            out.append(Finding(check.kind, [check.placeholder or check.name], {}, seen.rank(slot)))
            continue
        if world > 1 and (check.kind not in recorded or not _seen(check, float(recorded[check.kind]))):
            continue  # another rank saw it
        for finding in check.findings(step):
            details = {**finding.details, "check": finding.details.get("check", type(check).__name__)}
            out.append(replace(finding, rank=rank, details=details))
    return out


def _seen(check: Check, value: float) -> bool:
    return not math.isfinite(value) if check.seen_when == "nonfinite" else value > 0
