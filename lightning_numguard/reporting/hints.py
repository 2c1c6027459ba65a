"""The one source of hint text: what to try next, per incident kind, op, coverage problem and fill value.

Live warnings (:func:`~lightning_numguard.reporting.messages.incident_message`) and
``numguard explain`` both take their advice from here, through :func:`event_hint`, so that
one event gets the same advice wherever it is shown.

- :data:`KIND_HINTS` / :func:`kind_hint`: one sentence per incident kind;
- :data:`OP_DOMAIN_HINTS` / :func:`op_domain_hint`: one per op the op guard validates;
- :func:`op_hint`: one per autograd node (``SqrtBackward0``) that a replay or anomaly mode names;
- :data:`COVERAGE_PROBLEMS` / :func:`coverage_problem`: the problem and the hint per coverage
  code of :mod:`lightning_numguard.detect.coverage`;
- :data:`FILL_VALUES` / :func:`fill_value_name` / :func:`fill_value_hint`: sentinel values that
  mean "missing" in common data stacks;
- :func:`event_hint`: the hint for one event, given its kind and details.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from lightning_numguard.detect import registry
from lightning_numguard.diagnose.findings import AFTER_FORWARD

__all__ = [
    "COVERAGE_PROBLEMS",
    "FILL_VALUES",
    "INPUTS_ALREADY_BAD_HINT",
    "KIND_HINTS",
    "MASKED_ROW_HINT",
    "OP_DOMAIN_HINTS",
    "consequence_hint",
    "coverage_hint",
    "coverage_problem",
    "event_hint",
    "fill_value_hint",
    "fill_value_name",
    "kind_hint",
    "masked_row_hint",
    "op_domain_hint",
    "op_hint",
    "overflow_hint",
]

# --------------------------------------------------------------------------- incident kinds

KIND_HINTS: Mapping[str, str] = MappingProxyType(registry.kind_hints())
"""One sentence of advice per incident kind (every kind of :data:`~lightning_numguard.reporting.events.KINDS`)."""

_UNKNOWN_KIND = "an incident kind this version of lightning_numguard does not describe."


def kind_hint(kind: str) -> str:
    """The hint for one incident kind; a generic sentence for a kind this version does not know."""
    if kind in KIND_HINTS:
        return KIND_HINTS[kind]
    check = registry.check_of(kind)  # a check passed to NumGuardCallback(extra_checks=...)
    return check.hint if check is not None else _UNKNOWN_KIND


#: Kinds whose hint assumes that nothing upstream of them went bad in the same step.
_DOWNSTREAM_KINDS = ("nonfinite_output", "nonfinite_loss", "nonfinite_grad")


def consequence_hint(after: str) -> str:
    """The hint of a finding that follows the step's root cause ``after`` (a kind)."""
    return f"a consequence of the earlier {after} in this step: fix that first"


# --------------------------------------------------------------------------- op-domain ops

_INDEX_HINT = (
    "an index is negative or not smaller than the size of the indexed dimension: check the `dim` "
    "argument and how the index was computed (these ops do not wrap negative indices)"
)
_CLASS_HINT = (
    "a target class index is negative or not smaller than the number of classes C = input.size(1): "
    "make the output layer as wide as the label range (labels starting at 1, an extra background "
    "class) and mark padding with ignore_index (default -100)"
)
_EMBEDDING_HINT = (
    "a token id is negative or not smaller than num_embeddings: make the vocabulary size match the "
    "tokenizer (added special tokens, the padding id) or clamp out-of-vocabulary ids to an UNK id"
)

OP_DOMAIN_HINTS: dict[str, str] = {
    "binary_cross_entropy": (
        "use BCEWithLogitsLoss (it applies the sigmoid itself and is safe under autocast); "
        "or the input is already NaN/Inf upstream"
    ),
    "nll_loss": _CLASS_HINT,
    "cross_entropy": _CLASS_HINT,
    "embedding": _EMBEDDING_HINT,
    "embedding_bag": _EMBEDDING_HINT,
    "gather": _INDEX_HINT,
    "scatter": _INDEX_HINT,
    "scatter_add": _INDEX_HINT,
    "index_select": _INDEX_HINT,
    "one_hot": (
        "a label is negative or not smaller than num_classes: pass a num_classes that covers the label "
        "range and map ignore/padding labels (-100, -1) to a valid class before one_hot"
    ),
    "multinomial": (
        "the probabilities hold NaN/Inf or negative values, or a row is all zeros: sample from "
        "softmax(logits) (never negative), look for NaN upstream, and never mask out a whole row"
    ),
}
"""One hint per op the op guard validates (every op of ``GUARDED_OPS``)."""


def op_domain_hint(op: str) -> str | None:
    """The fix for a guarded op whose inputs were outside its domain; ``None`` for an op without one."""
    return OP_DOMAIN_HINTS.get(op)


# --------------------------------------------------------------------------- overflow from finite values

#: float16's largest finite value.
_FLOAT16_MAX = 65504.0

#: Inputs at least this large (in float32 or wider) mean the values themselves grew out of bounds.
HUGE_INPUT = 1e15


def overflow_hint(replay: Mapping[str, Any]) -> str | None:
    """The hint for a forward op that overflowed from finite inputs, from the replay's ``dtype`` and ``max_abs_in``.

    * a float16 op whose inputs fit float16 but whose result did not: the AMP overflow itself;
    * inputs already huge (``>= HUGE_INPUT``): the weights or activations grew step after step,
      which is what too high a learning rate does.

    ``None`` when the replay did not name a forward op or the overflow is neither.

    Example:
        >>> overflow_hint({"stage": "forward", "op": "matmul", "dtype": "float16", "max_abs_in": 900.0})[:30]
        '`matmul` overflowed float16 (m'
    """
    if replay.get("stage") != "forward":
        return None
    op, dtype, peak = replay.get("op"), replay.get("dtype"), replay.get("max_abs_in")
    if not isinstance(peak, (int, float)) or not math.isfinite(peak):
        return None
    if dtype == "float16" and peak < _FLOAT16_MAX:
        return (
            f"`{op}` overflowed float16 (max {_FLOAT16_MAX:g}) from finite inputs (largest |x| {peak:.3g}) under mixed "
            "precision: run this op in float32 (`with torch.autocast(device_type, enabled=False)` and `.float()` "
            "inputs), scale before the product (q / sqrt(d) for attention logits), or train in bf16-mixed"
        )
    if peak >= HUGE_INPUT:
        return (
            f"the inputs of `{op}` were finite but huge (largest |x| {peak:.3g}): the weights/activations grew "
            "step after step until they overflowed; the learning rate is probably too high: lower it, add "
            "warm-up, or clip gradients (Trainer(gradient_clip_val=1.0))"
        )
    return None


# --------------------------------------------------------------------------- masked rows, values made upstream

#: Forward ops that turn a row with no allowed position (every score ``-inf``) into NaN.
_MASKED_ROW_OPS = ("softmax", "log_softmax", "_softmax", "softmin", "scaled_dot_product_attention")

MASKED_ROW_HINT = (
    "a fully masked attention row: every score of a row was -inf, and softmax over it is 0/0 = NaN; fill "
    "masked scores with a large finite negative (torch.finfo(scores.dtype).min) instead of -inf, or guard "
    "rows with nothing to attend to (leave one position unmasked, or zero those rows' outputs)"
)

LITERAL_HINT = (
    "a NaN/Inf literal is written into a tensor there (`x[i] = float('nan')`, `* float('inf')`, `fill_`): "
    "remove it, or keep a finite value and a separate mask"
)
INPUTS_ALREADY_BAD_HINT = (
    "the batch and the weights were finite when checked, so the NaN/Inf was made after the batch check and "
    "before this module ran: look at what training_step does before calling it (an edit of the batch, a value "
    "computed there) and fix it at its source"
)
_INPUTS_UNCHECKED_HINT = (
    "the batch, the weights or code run before this module (in training_step) already held the NaN/Inf: add "
    "'inputs' to NumGuardCallback(check=...) to tell the batch apart, and fix the value at its source"
)


def masked_row_hint(replay: Mapping[str, Any]) -> str | None:
    """The hint for a forward op that made NaN of a fully masked row (softmax over all ``-inf``), else ``None``.

    Example:
        >>> masked_row_hint({"stage": "forward", "op": "softmax", "inf_in": True})[:26]
        'a fully masked attention r'
    """
    if replay.get("stage") != "forward" or replay.get("op") not in _MASKED_ROW_OPS:
        return None
    if replay.get("inf_in") or replay.get("op") == "scaled_dot_product_attention":
        return MASKED_ROW_HINT
    return None


# --------------------------------------------------------------------------- autograd nodes

_AUTOGRAD_HINTS: Mapping[str, str] = MappingProxyType(
    {
        "SqrtBackward": (
            "sqrt's gradient 1/(2*sqrt(x)) is infinite at x = 0 (the std of a constant channel, the "
            "norm of a zero vector): put an eps inside the root, "
            "torch.sqrt(x.var(dim, unbiased=False, keepdim=True) + eps)."
        ),
        "RsqrtBackward": "rsqrt(x) blows up at x = 0: use torch.rsqrt(x + eps).",
        "DivBackward": (
            "division by zero or a near-zero denominator (a std or norm of 0 in a normalisation): "
            "add an eps to the denominator, (x - mean) / (std + 1e-8)."
        ),
        "LogBackward": (
            "log(0) is -inf and its gradient 1/x infinite: clamp first, torch.log(x.clamp_min(eps)), "
            "or use the stable fused form (log_softmax, BCEWithLogitsLoss, logsumexp)."
        ),
        "PowBackward": (
            "x ** p with p < 1 has an infinite gradient at x = 0 (and a negative base with a "
            "fractional exponent is NaN): add an eps to the base or clamp it, or use "
            "torch.linalg.vector_norm for norms."
        ),
        "ExpBackward": "exp overflowed: subtract the max first (logsumexp) or clamp the exponent.",
        **dict.fromkeys(
            ("AcosBackward", "AsinBackward"),
            "acos'/asin' gradient is infinite at +-1: clamp the input to (-1 + eps, 1 - eps).",
        ),
        **dict.fromkeys(
            ("NormBackward", "LinalgVectorNormBackward"),
            "the gradient of a norm at a zero vector is 0/0: add an eps, or use a squared norm.",
        ),
    }
)


def op_hint(op: str) -> str | None:
    """The fix for an autograd op that produced NaN, if the op is a known offender.

    Args:
        op: the backward node's name as anomaly mode prints it, e.g. ``"SqrtBackward0"``.

    Returns:
        One sentence of advice, or ``None`` for an op without a specific hint.

    Example:
        >>> op_hint("DivBackward0").startswith("division by zero")
        True
    """
    return _AUTOGRAD_HINTS.get(re.sub(r"\d+$", "", op))


# --------------------------------------------------------------------------- optimizer coverage

COVERAGE_PROBLEMS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "frozen_in_optimizer": (
            "frozen parameters (requires_grad=False) handed to an optimizer",
            "build the optimizer from trainable parameters only, e.g. "
            "`Adam(p for p in model.parameters() if p.requires_grad)`; weight decay or a later "
            "unfreeze would otherwise move layers meant to stay fixed",
        ),
        "not_in_optimizer": (
            "trainable parameters in no optimizer",
            "add them to an optimizer's param groups, or set `requires_grad_(False)` if they are meant to stay fixed",
        ),
        "in_several_groups": (
            "parameters in more than one param group or optimizer",
            "each parameter must appear once: it is otherwise updated twice per step",
        ),
        "no_grad_in_first_step": (
            "trainable parameters that received no gradient in the first step",
            "they are unused in the forward pass (or detached): freeze them or remove them "
            "from the optimizer; under DDP also set find_unused_parameters",
        ),
    }
)
"""``(problem, hint)`` per code of :data:`lightning_numguard.detect.coverage.COVERAGE_CODES`.

Keyed by the codes' strings, so that reading hints never imports torch (``numguard explain``).
"""


def coverage_problem(code: str) -> tuple[str, str]:
    """``(problem, hint)`` for a coverage code (``"frozen_in_optimizer"``, ...).

    Raises:
        KeyError: ``code`` is not a coverage code.
    """
    return COVERAGE_PROBLEMS[code]


def coverage_hint(code: str) -> str:
    """The hint for a coverage code (the second half of :func:`coverage_problem`)."""
    return COVERAGE_PROBLEMS[code][1]


# --------------------------------------------------------------------------- fill values

FILL_VALUES: Mapping[str, float] = MappingProxyType(
    {
        "numpy's masked-array default fill value 1e20": 1e20,
        "netCDF's default float fill value 9.96921e36": 9.969209968386869e36,
        "float32's largest value (3.40282e38)": 3.4028234663852886e38,
        "float64's largest value": 1.7976931348623157e308,
    }
)
"""Sentinel values that mean "missing" in common data stacks, by name."""


def fill_value_name(value: float | None) -> str | None:
    """The name of the known fill value ``value`` equals (within float32 rounding), or ``None``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None
    for name, fill in FILL_VALUES.items():
        if math.isclose(abs(value), fill, rel_tol=1e-6):
            return name
    return None


def fill_value_hint(name: str) -> str:
    """The hint for a batch holding the fill value called ``name`` (a key of :data:`FILL_VALUES`)."""
    return (
        f"looks like a masked-array fill value leaked into the batch ({name}); fill masked "
        "entries with a real value (`np.ma.filled(a, 0)`) and keep the mask as a separate input"
    )


# --------------------------------------------------------------------------- one event


def event_hint(kind: str, details: Mapping[str, Any]) -> str:
    """The advice for one event: what a live message ends with and what ``numguard explain`` shows.

    The most specific hint known: a finding that follows the step's root cause (``details["after"]``)
    points at it; a fill value, a guarded op, a replayed forward op (a fully masked row, an overflow
    from finite inputs, inputs already bad), a replayed autograd op or a coverage problem gets its own
    hint; anything else the hint of its kind.

    Args:
        kind: the event's kind.
        details: the event's ``details`` (``max_abs``, ``op``, ``hint``, ``upstream``,
            ``replay``, ``after``, ``when``, ...; all optional).

    Returns:
        One sentence; :func:`kind_hint` for a kind without anything more specific.
    """
    after = details.get("after")
    if after and (kind in _DOWNSTREAM_KINDS or (kind == "nonfinite_param" and details.get("when") == AFTER_FORWARD)):
        return consequence_hint(after)
    replay = details.get("replay")
    replay = replay if isinstance(replay, Mapping) else {}
    specific: Any = None
    if kind == "suspicious_input":
        fill = fill_value_name(details.get("max_abs"))
        specific = fill and fill_value_hint(fill)
    elif kind == "op_domain":
        op, upstream = details.get("op"), details.get("upstream")
        own = details.get("hint") or (op_domain_hint(op) if isinstance(op, str) else None)
        below = f"the input is already non-finite upstream: first non-finite module was `{upstream}`"
        specific = "; ".join(str(part) for part in (own, upstream and below) if part)
    elif kind in ("nonfinite_output", "nonfinite_loss") and replay:
        specific = masked_row_hint(replay) or overflow_hint(replay) or (replay.get("literal") and LITERAL_HINT)
        if specific is None and replay.get("stage") == "inputs" and not replay.get("op"):
            checked = "inputs" in (details.get("checked") or ())
            specific = INPUTS_ALREADY_BAD_HINT if checked else _INPUTS_UNCHECKED_HINT
    elif kind == "nonfinite_grad" and isinstance(replay.get("op"), str):
        specific = op_hint(replay["op"])
    elif kind == "optimizer_coverage" and isinstance(details.get("hint"), str):
        specific = details["hint"]
    return str(specific) if specific else kind_hint(kind)
