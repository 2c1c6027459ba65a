"""The one source of hint text: what to try next, per incident kind, op, coverage problem and fill value.

Live warnings (:func:`~lightning_numguard.reporting.messages.incident_message`) and
``numguard explain`` both take their advice from here, through :func:`event_hint`, so that
one event gets the same advice wherever it is shown.

- :data:`KIND_HINTS` / :func:`kind_hint`: one sentence per incident kind;
- :data:`OP_DOMAIN_HINTS` / :func:`op_domain_hint`: one per op the op guard validates, with the offending values
  the guard measured (:func:`op_domain_advice`);
- :data:`FORWARD_OP_HINTS` / :func:`forward_op_hint`: one per forward op that a replay names as the culprit
  (``exp``, ``log``, ``div``, ``std``, ``ctc_loss``, ...), chosen by the op and worded from what the replay measured
  there (the exponent's value, the divisor's zero, the values a ``std`` reduced, the CTC frames);
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from lightning_numguard.detect import registry
from lightning_numguard.diagnose.findings import AFTER_FORWARD

__all__ = [
    "BUFFER_WRITTEN_LATE_HINT",
    "COMPILED_HINT",
    "COVERAGE_PROBLEMS",
    "DEVICE_FAULT_HINT",
    "FILL_VALUES",
    "FORWARD_OP_HINTS",
    "INPUTS_ALREADY_BAD_HINT",
    "KIND_HINTS",
    "MASKED_ROW_HINT",
    "OP_DOMAIN_HINTS",
    "THIS_RANK_HINT",
    "CulpritFacts",
    "canonical_op",
    "consequence_hint",
    "coverage_hint",
    "coverage_problem",
    "event_hint",
    "fill_value_hint",
    "fill_value_name",
    "forward_op_hint",
    "kind_hint",
    "masked_row_hint",
    "op_domain_advice",
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


#: The guarded ops whose advice names the offending value, and what that value is.
_DOMAIN_VALUE: Mapping[str, str] = MappingProxyType(
    {"embedding": "a token id", "embedding_bag": "a token id", "nll_loss": "a target", "cross_entropy": "a target"}
)


def op_domain_advice(op: str, details: Mapping[str, Any]) -> str | None:
    """:func:`op_domain_hint`, led by what the op guard measured (``details``: ``rule``, ``count``, ``nan_count``,
    ``min``, ``max``, as :meth:`OpGuard.describe <lightning_numguard.detect.opguard.OpGuard.describe>` gives them).

    A ``binary_cross_entropy`` input whose bad values are all NaN is an upstream NaN, not a missing sigmoid; values
    outside ``[0, 1]`` are no sigmoid's output; a token id or a class target past its bound is named with the bound.

    Example:
        >>> op_domain_advice("binary_cross_entropy", {"rule": "input in [0, 1]", "count": 4, "nan_count": 4})[:40]
        'all 4 bad inputs were NaN: a NaN made up'
    """
    base = op_domain_hint(op)
    if base is None:
        return None
    count, nans = _number(details.get("count")), _number(details.get("nan_count")) or 0.0
    low, high = _number(details.get("min")), _number(details.get("max"))
    rule = str(details.get("rule") or "")
    if not count:
        return base
    if op == "binary_cross_entropy":
        arg = "target" if rule.startswith("target") else "input"
        logits = "use BCEWithLogitsLoss on the raw logits (it applies the sigmoid itself and is safe under autocast)"
        if nans == count:
            were = f"the bad {arg} was NaN" if count == 1 else f"all {count:g} bad {arg}s were NaN"
            return (
                f"{were}: a NaN made upstream reached the loss, not a missing sigmoid; fix "
                f"it where it was made (the step's first non-finite module or op), and {logits}"
            )
        if low is None or high is None:
            return base
        bad = f"the bad {arg}s (from {low:.4g} to {high:.4g}) are outside [0, 1]"
        if arg == "input":
            return f"{bad}, so no sigmoid made them: {logits}"
        return f"{bad}: BCE takes probabilities as targets"
    what = _DOMAIN_VALUE.get(op)
    if what is None or low is None or high is None or not rule:
        return base
    return f"{what} of {low if low < 0 else high:g} breaks `{rule}`: {base}"


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
DEVICE_FAULT_HINT = (
    "nothing in the model or the data needs changing: the step was recovered like any other; a device that keeps "
    "doing it is faulty (silent data corruption), and NumGuard halts with SuspectedHardwareError after "
    "recovery.max_device_faults faults on one rank, naming the node to exclude"
)
BUFFER_WRITTEN_LATE_HINT = (
    "a buffer went non-finite during this step while the weights and the buffers it started from were finite: a "
    "value written into a buffer (in training_step or a hook before the forward pass: `fill_`, an in-place update) "
    'or by the forward pass; read one step late (sync_mode="deferred") the step is gone, so neither the buffer nor '
    'the write is named: run the same data with sync_mode="every_step" to name them at their line'
)
THIS_RANK_HINT = (
    "unless code runs differently on this rank (a branch on the rank, a rank's own data, state or seed), nothing in "
    "the model or the data needs changing: the step was recovered like any other; a device that keeps doing it is "
    "faulty, and NumGuard halts with SuspectedHardwareError after recovery.max_device_faults faults on one rank, "
    "naming the node to exclude"
)
COMPILED_HINT = (
    "confirm by training without torch.compile; to find the kernel, run with TORCHINDUCTOR_NAN_ASSERTS=1 or bisect "
    "the compiler (python -m torch._inductor.compiler_bisector)"
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


# --------------------------------------------------------------------------- forward ops, worded from what was measured

#: The largest finite value of each floating dtype, by the name the events spell (hints never import torch).
_DTYPE_MAX: Mapping[str, float] = MappingProxyType(
    {
        "float16": _FLOAT16_MAX,
        "bfloat16": 3.3895313892515355e38,
        "float32": 3.4028234663852886e38,
        "float64": 1.7976931348623157e308,
    }
)

#: Other spellings of the ops below: aten names (a replay without the torch-level call), aliases, in-place forms.
_SPELLINGS: Mapping[str, str] = MappingProxyType(
    {
        "arccos": "acos",
        "arcsin": "asin",
        "arctanh": "atanh",
        "true_divide": "div",
        "divide": "div",
        "special_expm1": "expm1",
        "special_exp2": "exp2",
        "special_log1p": "log1p",
        "float_power": "pow",
        "square": "pow",
        "std_mean": "std",
        "var_mean": "var",
        "_softmax": "softmax",
        "_log_softmax": "log_softmax",
        "special_softmax": "softmax",
        "special_log_softmax": "log_softmax",
        "_ctc_loss": "ctc_loss",
        "nll_loss_forward": "nll_loss",
        "nll_loss2d_forward": "nll_loss",
        "nll_loss2d": "nll_loss",
        "nll_loss_nd": "nll_loss",
    }
)


@dataclass(frozen=True)
class CulpritFacts:
    """What a replay measured at a forward culprit (``details["replay"]``), read leniently (older events lack some):
    what each advice of :data:`FORWARD_OP_HINTS` is worded from."""

    op: str
    dtype: str
    peak: float | None  # the largest finite |x| the op read
    low: float | None  # the smallest finite value it read
    high: float | None  # the largest finite value it read
    inf_in: bool  # an input held ±Inf
    made: str | None  # "nan" or "inf": what the op made
    raw: Mapping[str, Any]

    @classmethod
    def of(cls, replay: Mapping[str, Any]) -> CulpritFacts:
        dtype = replay.get("dtype")
        return cls(
            op=canonical_op(str(replay.get("op"))),
            dtype=dtype if isinstance(dtype, str) else "float32",
            peak=_number(replay.get("max_abs_in")),
            low=_number(replay.get("min_in")),
            high=_number(replay.get("max_in")),
            inf_in=bool(replay.get("inf_in")),
            made=replay.get("made") if replay.get("made") in ("nan", "inf") else None,
            raw=replay,
        )

    @property
    def largest(self) -> float:
        return _DTYPE_MAX.get(self.dtype, _DTYPE_MAX["float32"])


def _number(value: Any) -> float | None:
    """A finite number read back from an event, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _exp_hint(f: CulpritFacts) -> str:
    """exp, expm1, exp2, sinh, cosh: the exponent went past the log of the dtype's largest value."""
    limit = math.log2(f.largest) if f.op == "exp2" else math.log(f.largest)
    top = f.high if f.high is not None else f.peak
    said = f"the exponent reached {top:.6g}; " if top is not None else ""
    return (
        f"{said}{f.op} overflows {f.dtype} above {limit:.3g}: clamp the exponent first "
        f"(x.clamp(max={math.floor(limit)})), or compute in log space: torch.logsumexp instead of "
        "exp(x).sum().log(), F.softmax / F.log_softmax instead of exp(x) / exp(x).sum(), F.softplus(x) for "
        "log(1 + exp(x)), and keep a scale as its log"
    )


def _pow_hint(f: CulpritFacts) -> str:
    if f.made == "nan" and f.low is not None and f.low < 0:
        return (
            f"a negative base ({f.low:.4g}) to a fractional power is NaN: raise the magnitude and keep the sign "
            "(x.abs() ** p * x.sign()), clamp the base to >= 0 first, or keep the base positive by construction "
            "(softplus, exp)"
        )
    read = f" (inputs up to |x| = {f.peak:.4g})" if f.peak is not None else ""
    return (
        f"`pow` overflowed {f.dtype}, whose largest value is {f.largest:.4g}{read}: clamp the base or the exponent, "
        "or compute in log space (p * log(x) rather than log(x ** p), exp only at the end); a base of 0 to a negative "
        "power is Inf too: add an eps to the base"
    )


def _log_hint(f: CulpritFacts) -> str:
    floor = -1.0 if f.op == "log1p" else 0.0
    edge = "-1" if f.op == "log1p" else "0"
    if f.made == "nan" or (f.low is not None and f.low < floor):
        low = f" (its smallest input was {f.low:.4g})" if f.low is not None and f.low < floor else ""
        what = f"`{f.op}` of a value below {edge} is NaN{low}"
    else:
        exact = " (an input was exactly 0)" if f.low == floor and floor == 0 else ""
        what = f"`{f.op}` of {edge} is -inf{exact}"
    clamp = "x.clamp_min(-1 + eps)" if f.op == "log1p" else "x.clamp_min(eps)"
    return (
        f"{what}: clamp first, torch.{f.op}({clamp}); for the log of probabilities use F.log_softmax (log(softmax(x)) "
        "underflows to log(0)) or BCEWithLogitsLoss; for x * log(x) terms (an entropy) use torch.xlogy(x, x), "
        "which is 0 at x = 0"
    )


#: What a divisor is, read from the call's line after its ``/`` (``x.std(...)``, ``mask.sum(...)``), and its zero.
_DIVISORS = (
    ("std", "a zero std (a constant row: all its values equal)"),
    ("var", "a zero variance (a constant row)"),
    ("norm", "a zero norm (an all-zero vector)"),
    ("sum", "a sum of 0 (an empty mask or group)"),
    ("count_nonzero", "a count of 0 (an empty mask or group)"),
    ("sqrt", "a root of 0"),
)


def _divisor(code: Any) -> str | None:
    """The divisor of the first ``/`` on the user's line, when it is a known statistic (``x.std(...)``)."""
    if not isinstance(code, str) or not re.search(r"(?<!/)/(?![/=])", code):
        return None
    tail = re.split(r"(?<!/)/(?![/=])", code, maxsplit=1)[1]
    return next((words for name, words in _DIVISORS if re.search(rf"\b{name}\(", tail)), None)


def _div_hint(f: CulpritFacts) -> str:
    zero = f.raw.get("zero_divisor")
    name = "a division" if f.op == "div" else f"`{f.op}`"
    by = _divisor(f.raw.get("code")) if f.op == "div" else None
    if zero:
        what = f"{name} by {by}" if by else f"{name} by 0 (a divisor held 0)"
        what += "; the numerator was 0 too (0/0)" if f.made == "nan" else ""
    elif zero is False and f.peak is not None:
        what = f"{name} overflowed {f.dtype} (no divisor was 0, but one was close to it; largest |x| read {f.peak:.3g})"
    else:
        what = f"{name} by {by or 0} or by a value close to it"
    return (
        f"{what}: add an eps where it divides, x / (d + eps) or x / d.clamp_min(eps) (a constant row's std is 0, a "
        "zero vector's norm is 0), or find the mask or filter that left the denominator 0 (an empty group, a count "
        "of 0, a row with nothing selected) and leave those rows out"
    )


def _sqrt_hint(f: CulpritFacts) -> str:
    if f.made == "nan" or (f.low is not None and f.low < 0):
        low = f" ({f.low:.3g})" if f.low is not None and f.low < 0 else ""
        return (
            f"`{f.op}` of a negative value{low} is NaN: a quantity that is >= 0 in exact arithmetic went below 0 by "
            "rounding (E[x^2] - E[x]^2, a difference of squared norms): clamp before the root, "
            f"torch.{f.op}(v.clamp_min(0) + eps), or compute it the stable way (x.var(unbiased=False), "
            "torch.linalg.vector_norm, torch.cdist)"
        )
    return (
        f"`{f.op}` of 0 is Inf (a variance or mean square of 0: a constant or all-zero row): add an eps inside, "
        f"torch.{f.op}(v + eps), as LayerNorm and RMSNorm do"
    )


def _spread_hint(f: CulpritFacts) -> str:
    count, correction = _number(f.raw.get("reduced_over")), _number(f.raw.get("correction"))
    if count is not None and correction is not None and count <= correction:
        values = f"{count:g} value" + ("" if count == 1 else "s")
        return (
            f"`{f.op}` over {values} with correction={correction:g} divides by N - correction = "
            f"{count - correction:g}: a batch of one sample (the last, smaller batch of an epoch) or a dimension of "
            "size 1; pass correction=0 (unbiased=False), or drop the short batch with DataLoader(drop_last=True)"
        )
    read = f" (largest |x| {f.peak:.3g})" if f.peak is not None else ""
    return (
        f"`{f.op}` overflowed {f.dtype} squaring its inputs{read}: scale them down first; and a constant row's std is "
        "0, so add an eps wherever it divides"
    )


def _arc_hint(f: CulpritFacts) -> str:
    beyond = [v for v in (f.low, f.high) if v is not None and abs(v) > 1]
    if beyond:
        what = f"the input of `{f.op}` reached {max(beyond, key=abs):.9g}, outside [-1, 1]"
    elif f.op == "atanh":
        what = "`atanh` of ±1 is ±Inf"
    else:
        what = f"the input of `{f.op}` was outside [-1, 1]"
    return (
        f"{what} (often a cosine or a correlation computed by hand, which rounds past ±1): clamp to ±(1 - eps) first, "
        "x.clamp(-1 + 1e-6, 1 - 1e-6) (eps 1e-3 in float16)"
    )


def _softmax_hint(f: CulpritFacts) -> str | None:
    return MASKED_ROW_HINT if f.inf_in or f.op == "scaled_dot_product_attention" else None


def _ctc_hint(f: CulpritFacts) -> str:
    short, needed, frames = (_number(f.raw.get(k)) for k in ("short_samples", "frames_needed", "frames"))
    if short is not None and needed is not None and frames is not None:
        samples = f"{short:g} sample" + (" has" if short == 1 else "s have")
        what = (
            f"{samples} a target that needs more input frames than it has (one needs {needed:g}, it has {frames:g}: "
            "one frame per label and a blank between two equal labels in a row)"
        )
    else:
        what = "a target needs more input frames than its sample has (one per label, a blank between repeated labels)"
    return (
        f"{what}, and the CTC loss of such a sample is -log(0) = Inf: pass zero_infinity=True "
        "(nn.CTCLoss(zero_infinity=True)), or drop samples whose targets are longer than their input frames (or "
        "downsample the input less)"
    )


def _kl_hint(f: CulpritFacts) -> str:
    if f.inf_in:
        return (
            "the input of `kl_div` holds -inf (the log of a probability of 0: log(softmax(x)) underflows, or a -inf "
            "mask): compute it with F.log_softmax, which stays finite, and mask with a finite value; pass "
            "log_target=True when the target is log-probabilities too"
        )
    if f.low is not None and f.low < 0:
        return (
            f"the target of `kl_div` holds negative values (down to {f.low:.4g}): log-probabilities read as "
            "probabilities, whose log is NaN; pass log_target=True, or give the target as probabilities"
        )
    return (
        "`kl_div` takes its input as log-probabilities (F.log_softmax, not log(softmax(x)), whose log(0) is -inf) and "
        "its target as probabilities, or as log-probabilities with log_target=True"
    )


def _class_loss_hint(f: CulpritFacts) -> str | None:
    counted, ignored = f.raw.get("labels_counted"), f.raw.get("ignore_index")
    if counted == 0:
        value = f" ({ignored})" if isinstance(ignored, int) else ""
        return (
            f"every label of the batch was ignore_index{value}, so the mean over 0 labels is 0/0 = NaN: leave out "
            "batches with no labelled position (a fully padded batch), or use reduction='sum' and divide by "
            "max(number of labels, 1)"
        )
    if isinstance(counted, int):
        return "the class weights of every counted label are 0, so the weighted mean is 0/0: give each class a weight"
    return None


FORWARD_OP_HINTS: Mapping[str, Callable[[CulpritFacts], str | None]] = MappingProxyType(
    {
        **dict.fromkeys(("exp", "expm1", "exp2", "sinh", "cosh"), _exp_hint),
        "pow": _pow_hint,
        **dict.fromkeys(("log", "log2", "log10", "log1p"), _log_hint),
        **dict.fromkeys(("div", "reciprocal", "remainder", "fmod"), _div_hint),
        **dict.fromkeys(("sqrt", "rsqrt"), _sqrt_hint),
        **dict.fromkeys(("std", "var"), _spread_hint),
        **dict.fromkeys(("acos", "asin", "atanh"), _arc_hint),
        **dict.fromkeys(_MASKED_ROW_OPS, _softmax_hint),
        "ctc_loss": _ctc_hint,
        "kl_div": _kl_hint,
        **dict.fromkeys(("cross_entropy", "nll_loss"), _class_loss_hint),
    }
)
"""The advice per forward op a replay names as the culprit (by :func:`canonical_op`), worded from what it measured.

An op whose advice has nothing to say for the facts measured (a ``softmax`` without a ±Inf input), and any op not
here (``linear``, ``matmul``, ...), gets :func:`overflow_hint` when its inputs explain an overflow, else its kind's
hint.
"""


def canonical_op(op: str) -> str:
    """The name :data:`FORWARD_OP_HINTS` knows ``op`` by: ``exp_`` -> ``exp``, ``arccos`` -> ``acos``,
    ``_log_softmax`` -> ``log_softmax``, ``nll_loss_forward`` -> ``nll_loss``."""
    name = op[:-1] if op.endswith("_") and not op.startswith("_") else op
    return _SPELLINGS.get(name, name)


def forward_op_hint(replay: Mapping[str, Any]) -> str | None:
    """The advice for the forward op a replay named as the culprit (``stage="forward"``), else ``None``.

    Chosen by the op (:data:`FORWARD_OP_HINTS`) and worded from what the replay measured there: the dtype, the
    smallest, largest and largest-magnitude values read, whether an input held ±Inf, what the op made (NaN or Inf),
    and for a few ops a zero divisor, the values a ``std`` reduced, the CTC frames, the labels counted. An op
    without an entry, or whose entry has nothing to say, gets :func:`overflow_hint` (float16 overflow, inputs
    grown huge) or ``None``.

    Example:
        >>> forward_op_hint({"stage": "forward", "op": "exp", "dtype": "float32", "max_in": 1146.0})[:60]
        'the exponent reached 1146; exp overflows float32 above 88.7:'
    """
    if replay.get("stage") != "forward" or not isinstance(replay.get("op"), str):
        return None
    facts = CulpritFacts.of(replay)
    advise = FORWARD_OP_HINTS.get(facts.op)
    return (advise(facts) if advise is not None else None) or overflow_hint(replay)


# --------------------------------------------------------------------------- autograd nodes

_ARC_GRADIENT = (
    "the gradient of acos, asin and atanh is infinite at ±1 (a cosine of two parallel vectors is exactly 1): clamp "
    "the input to ±(1 - eps) first, x.clamp(-1 + 1e-6, 1 - 1e-6)."
)
_AUTOGRAD_HINTS: Mapping[str, str] = MappingProxyType(
    {
        "SqrtBackward": (
            "sqrt's gradient 1/(2*sqrt(x)) is infinite at x = 0 (a distance between two equal points, the norm of a "
            "zero vector, the std of a constant row): put an eps inside the root, torch.sqrt(x + eps), or use "
            "torch.linalg.vector_norm / torch.cdist, whose gradient at 0 is 0."
        ),
        "RsqrtBackward": "rsqrt(x) and its gradient blow up at x = 0: use torch.rsqrt(x + eps).",
        "DivBackward": (
            "division by zero or a near-zero denominator (a std or norm of 0 in a normalisation): "
            "add an eps to the denominator, (x - mean) / (std + 1e-8)."
        ),
        "LogBackward": (
            "log's gradient 1/x is infinite at 0: clamp first, torch.log(x.clamp_min(eps)), "
            "or use the stable fused form (log_softmax, BCEWithLogitsLoss, logsumexp)."
        ),
        "PowBackward": (
            "x ** p with p < 1 has an infinite gradient at x = 0 (and a negative base with a "
            "fractional exponent is NaN): add an eps to the base or clamp it, or use "
            "torch.linalg.vector_norm for norms (its gradient at 0 is 0)."
        ),
        "ExpBackward": "exp's gradient exp(x) overflowed: subtract the max first (logsumexp) or clamp the exponent.",
        **dict.fromkeys(("AcosBackward", "AsinBackward", "AtanhBackward"), _ARC_GRADIENT),
        **dict.fromkeys(
            ("NormBackward", "LinalgVectorNormBackward"),
            "a norm's gradient at a zero vector is 0/0 for some orders: add an eps, or use a squared norm.",
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
    points at it; a fill value, a guarded op (with the values it refused), a replayed forward op (its
    entry in :data:`FORWARD_OP_HINTS`, worded from what the replay measured; an overflow from finite
    inputs; a literal; inputs already bad), a replayed autograd op or a coverage problem gets its own
    hint; anything else (an op with no entry) the hint of its kind.

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
    if kind in _DOWNSTREAM_KINDS and details.get("buffer_written"):
        return BUFFER_WRITTEN_LATE_HINT
    fault = details.get("device_fault")
    if kind in _DOWNSTREAM_KINDS and fault:  # it did not come back when the step was re-run (or only on its rank)
        this_rank = isinstance(fault, Mapping) and fault.get("verdict") == "this_rank"
        return THIS_RANK_HINT if this_rank else DEVICE_FAULT_HINT
    if kind in _DOWNSTREAM_KINDS and details.get("compiled"):
        return COMPILED_HINT
    replay = details.get("replay")
    replay = replay if isinstance(replay, Mapping) else {}
    specific: Any = None
    if kind == "suspicious_input":
        fill = fill_value_name(details.get("max_abs"))
        specific = fill and fill_value_hint(fill)
    elif kind == "op_domain":
        op, upstream = details.get("op"), details.get("upstream")
        own = details.get("hint") or (op_domain_advice(op, details) if isinstance(op, str) else None)
        below = f"the input is already non-finite upstream: first non-finite module was `{upstream}`"
        specific = "; ".join(str(part) for part in (own, upstream and below) if part)
    elif kind in ("nonfinite_output", "nonfinite_loss") and replay:
        specific = (replay.get("literal") and LITERAL_HINT) or forward_op_hint(replay)
        if specific is None and replay.get("stage") == "inputs" and not replay.get("op"):
            checked = "inputs" in (details.get("checked") or ())
            specific = INPUTS_ALREADY_BAD_HINT if checked else _INPUTS_UNCHECKED_HINT
    elif kind == "nonfinite_grad" and isinstance(replay.get("op"), str):
        specific = op_hint(replay["op"])
    elif kind == "optimizer_coverage" and isinstance(details.get("hint"), str):
        specific = details["hint"]
    return str(specific) if specific else kind_hint(kind)
