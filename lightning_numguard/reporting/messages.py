"""One-sentence messages, shared by warnings, exceptions, events and the CLI; the hints come from :mod:`.hints`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_numguard.reporting.hints import KIND_HINTS, event_hint, fill_value_name

__all__ = ["incident_message"]


def _names(where: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{w}`" for w in where[:limit])
    if len(where) > limit:
        shown += f" and {len(where) - limit} more"
    return shown


def incident_message(kind: str, where: Sequence[str], details: dict[str, Any], step: int, rank: int) -> str:
    """The one human sentence of an event: what, where, when, and the likely fix.

    The fix is :func:`~lightning_numguard.reporting.hints.event_hint`, the same advice
    ``numguard explain`` gives for the event; a kind this version does not know gets none.
    """
    at = f"at step {step} on rank {rank}"
    names = _names(where)
    hint = event_hint(kind, details) if kind in KIND_HINTS else ""
    if kind == "nonfinite_input":
        text = f"non-finite value in {names} {at}"
        stats = details.get("stats") or {}
        if stats:
            text += f" ({stats.get('nan', 0)} NaN, {stats.get('posinf', 0)} +Inf, {stats.get('neginf', 0)} -Inf)"
    elif kind == "suspicious_input":
        value = details.get("max_abs")
        text = f"suspiciously large finite value {value:.6g} in {names} {at}" if value else f"huge value in {names}"
        if fill_value_name(value):
            return f"{text}: {hint}"
    elif kind == "nonfinite_output":
        text = f"module {names} produced the first non-finite output {at}"
        replay = details.get("replay") or {}
        if replay.get("forward_op"):
            inside = f" in `{replay['forward_op_module']}`" if replay.get("forward_op_module") else ""
            text += f"; replay traced it to op `{replay['forward_op']}`{inside}"
        elif replay.get("op"):
            text += f"; replay traced it to autograd op `{replay['op']}`"
    elif kind == "op_domain":
        op = details.get("op", where[0] if where else "op")
        module = details.get("module")
        text = f"`{op}` got inputs outside its domain ({details.get('rule', '')})"
        if module:
            text += f" in module `{module}`"
        text += f" {at}"
        if details.get("count") is not None:
            text += f": {details['count']} bad values, min {details.get('min')}, max {details.get('max')}"
    elif kind == "nonfinite_loss":
        text = f"the loss is non-finite {at}"
    elif kind == "nonfinite_grad":
        text = f"non-finite gradient in {names} {at}"
        replay = details.get("replay") or {}
        if replay.get("op"):
            module = f" in `{replay['module']}`" if replay.get("module") else ""
            text += f"; the first autograd op to return NaN/Inf was `{replay['op']}`{module}"
    elif kind == "nonfinite_param":
        when = details.get("when")
        text = f"non-finite values in {names} {when + ' ' if when else ''}{at}"
    elif kind == "optimizer_coverage":
        text = f"{details.get('problem', 'optimizer coverage problem')}: {names}"
    else:
        text = f"{kind} in {names} {at}"
    return f"{text}; {hint}" if hint else text
