"""One-sentence messages with hints, shared by warnings, exceptions, events and the CLI."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_numguard.reporting.catalogue import op_hint

__all__ = ["FILL_VALUES", "HINTS", "fill_value_name", "incident_message"]

#: Sentinel values that mean "missing" in common data stacks, by name.
FILL_VALUES: dict[str, float] = {
    "numpy's masked-array default fill value 1e20": 1e20,
    "netCDF's default float fill value 9.96921e36": 9.969209968386869e36,
    "float32's largest value (3.40282e38)": 3.4028234663852886e38,
    "float64's largest value": 1.7976931348623157e308,
}

HINTS: dict[str, str] = {
    "nonfinite_input": "the data is bad before the model sees it: check the dataset/transforms for NaN "
    "(missing values, log(0), 0/0) and clean or drop those samples",
    "suspicious_input": "finite values this large overflow in the first layers; mask or clip them in the data pipeline",
    "nonfinite_output": "this module is the first to produce NaN/Inf from finite inputs: look for division "
    "by a zero std, sqrt/log of 0 or negatives, exp overflow; add an eps or clamp",
    "op_domain": "the op's inputs were outside its domain and would trigger a device-side assert on CUDA",
    "nonfinite_loss": "inputs and module outputs were finite, so the loss computation itself overflowed: "
    "use the numerically stable form (BCEWithLogitsLoss, log_softmax + nll_loss) or add an eps",
    "nonfinite_grad": "the forward pass was finite but the backward was not: a sqrt/pow/norm at 0 or a "
    "division by a small number in backward; add an eps or lower the learning rate",
    "nonfinite_param": "the weights themselves are no longer finite (an earlier bad update, or the optimizer "
    "state): restore a finite state and lower the learning rate",
    "optimizer_coverage": "build the optimizer from `[p for p in model.parameters() if p.requires_grad]` "
    "and give every trainable parameter exactly one param group",
}


def fill_value_name(value: float | None) -> str | None:
    """The name of the known fill value ``value`` equals (within float32 rounding), or ``None``."""
    if value is None or not math.isfinite(value):
        return None
    for name, fill in FILL_VALUES.items():
        if math.isclose(abs(value), fill, rel_tol=1e-6):
            return name
    return None


def _names(where: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{w}`" for w in where[:limit])
    if len(where) > limit:
        shown += f" and {len(where) - limit} more"
    return shown


#: Kinds whose hint assumes that nothing upstream of them went bad in the same step.
_DOWNSTREAM_KINDS = ("nonfinite_output", "nonfinite_loss", "nonfinite_grad")


def _hint(kind: str, details: dict[str, Any]) -> str:
    """The kind's hint, or a pointer to the step's root cause when this finding came after it."""
    after = details.get("after")
    downstream = kind in _DOWNSTREAM_KINDS or (
        kind == "nonfinite_param" and details.get("when") == "after the forward pass"
    )
    if after and downstream:
        return f"a consequence of the earlier {after} in this step: fix that first"
    return HINTS.get(kind, "")


def incident_message(kind: str, where: Sequence[str], details: dict[str, Any], step: int, rank: int) -> str:
    """The one human sentence of an event: what, where, when, and the likely fix."""
    at = f"at step {step} on rank {rank}"
    names = _names(where)
    if kind == "nonfinite_input":
        text = f"non-finite value in {names} {at}"
        stats = details.get("stats") or {}
        if stats:
            text += f" ({stats.get('nan', 0)} NaN, {stats.get('posinf', 0)} +Inf, {stats.get('neginf', 0)} -Inf)"
    elif kind == "suspicious_input":
        value = details.get("max_abs")
        fill = fill_value_name(value)
        text = f"suspiciously large finite value {value:.6g} in {names} {at}" if value else f"huge value in {names}"
        if fill:
            return (
                f"{text}: looks like a masked-array fill value leaked into the batch ({fill}); fill masked "
                "entries with a real value (`np.ma.filled(a, 0)`) and keep the mask as a separate input"
            )
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
        hint = details.get("hint")
        upstream = details.get("upstream")
        if upstream:
            hint = (
                hint + "; " if hint else ""
            ) + f"the input is already non-finite upstream: first non-finite module was `{upstream}`"
        return f"{text}; {hint}" if hint else text
    elif kind == "nonfinite_loss":
        text = f"the loss is non-finite {at}"
    elif kind == "nonfinite_grad":
        text = f"non-finite gradient in {names} {at}"
        replay = details.get("replay") or {}
        if replay.get("op"):
            module = f" in `{replay['module']}`" if replay.get("module") else ""
            fix = (op_hint(replay["op"]) if not details.get("after") else None) or _hint(kind, details)
            return f"{text}; the first autograd op to return NaN/Inf was `{replay['op']}`{module}; {fix}"
    elif kind == "nonfinite_param":
        when = details.get("when")
        text = f"non-finite values in {names} {when + ' ' if when else ''}{at}"
    elif kind == "optimizer_coverage":
        problem = details.get("problem", "optimizer coverage problem")
        return f"{problem}: {names}; {details.get('hint', HINTS[kind])}"
    else:
        text = f"{kind} in {names} {at}"
    return f"{text}; {_hint(kind, details)}".rstrip("; ")
