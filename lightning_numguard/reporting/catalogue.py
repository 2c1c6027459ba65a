"""Known NaN/Inf failure signatures and the hints shared by every report.

``CATALOGUE`` lists what a run *without* the guard prints when it dies of a non-finite
value: each :class:`Pattern` names the log line that gives the failure away, its usual
cause, the fix, and the incident kind under which ``NumGuardCallback`` would have recorded
it first. The list is in severity order, most specific first: a log line is attributed to
the first entry that matches it (so a BCE assertion is never also reported as a generic
kernel assertion). Entries marked ``follow_on`` are errors that only ever follow another
failure (cuBLAS/cuDNN errors after a device-side assert), so they never outrank a cause.

``KIND_HINTS`` holds one hint per incident kind of ``events.jsonl``; ``op_hint`` one per
autograd op that anomaly mode or a replay names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from lightning_numguard.core.events import ACTIONS, KINDS

__all__ = ["ACTIONS", "CATALOGUE", "EVENT_KINDS", "KIND_HINTS", "Pattern", "kind_hint", "op_hint"]

EVENT_KINDS: tuple[str, ...] = KINDS
"""Every incident kind an ``events.jsonl`` line may carry."""

_GUARD = "NumGuardCallback"

KIND_HINTS: Mapping[str, str] = MappingProxyType(
    {
        "nonfinite_input": (
            "the batch already held NaN/Inf before the model ran: check the dataset and transforms "
            "(division by a zero std in normalisation, log of 0, masked-array fill values "
            "1e20 / 9.96921e36 overflowing to inf); the model is not the culprit."
        ),
        "suspicious_input": (
            "finite but absurdly large values in the batch, typically masked-array fill values "
            "(1e20, 9.96921e36) leaking through plain numpy ops: use np.ma functions or fill "
            "masked entries explicitly before converting to tensors."
        ),
        "nonfinite_output": (
            "the first module whose output went non-finite from finite inputs is the culprit: look "
            "for sqrt/log/division/pow without an eps, exp overflow, or weights already bad "
            "(a nonfinite_param event at the same step)."
        ),
        "nonfinite_loss": (
            "the loss went non-finite while the inputs and module outputs were finite: the loss "
            "function got values outside its domain (log(0), BCE on non-probabilities: use "
            "BCEWithLogitsLoss) or overflowed in fp16; clamp or use the numerically stable variant."
        ),
        "nonfinite_grad": (
            "the forward pass was finite but the backward was not: a backward formula blew up "
            "(sqrt(0), x/0, pow with a fractional exponent at 0); add an eps inside the op, lower the "
            "learning rate or clip gradients. Under fp16 AMP occasional inf gradients are normal and "
            "handled by the GradScaler."
        ),
        "nonfinite_param": (
            "parameters, buffers or optimizer state went non-finite: an optimizer update with "
            "huge/inf gradients, a learning rate that is too high, or frozen layers handed to the "
            "optimizer; roll back and lower the learning rate."
        ),
        "optimizer_coverage": (
            "the optimizer does not match the trainable parameters: pass only "
            "filter(lambda p: p.requires_grad, model.parameters()) to the optimizer, and give every "
            "trainable parameter to exactly one optimizer param group."
        ),
        "op_domain": (
            "an op received inputs outside its domain and would have tripped a device-side assert "
            "(BCE input outside [0, 1], class index >= n_classes, embedding index out of range); "
            "fix the values feeding that op (often an upstream NaN, or a label/vocabulary off by one)."
        ),
    }
)
"""One hint per incident kind, for reports of ``events.jsonl``."""

_OP_HINTS: Mapping[str, str] = MappingProxyType(
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
        "AcosBackward": "acos'/asin' gradient is infinite at +-1: clamp the input to (-1 + eps, 1 - eps).",
        "AsinBackward": "acos'/asin' gradient is infinite at +-1: clamp the input to (-1 + eps, 1 - eps).",
        "NormBackward": "the gradient of a norm at a zero vector is 0/0: add an eps, or use a squared norm.",
        "LinalgVectorNormBackward": "the gradient of a norm at a zero vector is 0/0: add an eps.",
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
    return _OP_HINTS.get(re.sub(r"\d+$", "", op))


def kind_hint(kind: str) -> str:
    """The hint for one incident kind; a generic sentence for a kind this version does not know."""
    return KIND_HINTS.get(kind, "an incident kind this version of lightning_numguard does not describe.")


@dataclass(frozen=True)
class Pattern:
    """One known failure signature.

    Args:
        name: a short stable identifier, e.g. ``"bce_input_range"``.
        regex: the compiled expression, searched in each log line; named groups (``op``,
            ``target``, ...) are reported with the match.
        cause: what usually produces this line.
        fix: what to change.
        hint_kind: the ``events.jsonl`` kind under which ``NumGuardCallback`` records this
            failure, before it can crash the run.
        follow_on: the line only ever follows another failure (it is never the root cause
            when a cause is in the log too).
    """

    name: str
    regex: re.Pattern[str]
    cause: str
    fix: str
    hint_kind: str
    follow_on: bool = False


def _p(name: str, regex: str, cause: str, fix: str, hint_kind: str, *, follow_on: bool = False) -> Pattern:
    return Pattern(name, re.compile(regex), cause, fix, hint_kind, follow_on)


_LOCATE = f"{_GUARD} names the first batch field or module that went non-finite, and the step."

CATALOGUE: tuple[Pattern, ...] = (
    _p(
        "bce_input_range",
        r"Assertion `input_val >= zero && input_val <= \w+` failed"
        r"|all elements of input should be between 0 and 1",
        "BCELoss/F.binary_cross_entropy got an input outside [0, 1]: either the model's last layer is "
        "not a sigmoid, or an upstream NaN reached the loss (NaN fails the range check too).",
        "Use BCEWithLogitsLoss on raw logits instead of sigmoid + BCELoss; if the model does end in a "
        f"sigmoid the input is NaN, so find where it first went non-finite: {_LOCATE}",
        "op_domain",
    ),
    _p(
        "class_index_out_of_bounds",
        r"Assertion `[^`]*< n_classes` failed"
        r"|Target -?\d+ is out of bounds"
        r"|IndexError: Target .* is out of bounds",
        "cross_entropy/nll_loss got a class index < 0 or >= the number of classes (labels counted from 1, "
        "a dataset with more classes than the model's output, or an ignore label without ignore_index).",
        "Check the label range against the logits' class dimension (targets must be in [0, C)); pass "
        f"ignore_index for padding labels. {_GUARD} validates the targets before the kernel runs.",
        "op_domain",
    ),
    _p(
        "embedding_index_out_of_range",
        r"index out of range in self"
        r"|srcIndex < srcSelectDimSize"
        r"|indexSelect(?:Large|Small)Index",
        "an nn.Embedding (or index_select) got an index >= num_embeddings or < 0: a vocabulary or "
        "tokenizer larger than the embedding table, or padding/special ids outside it.",
        "Make num_embeddings cover every id (len(tokenizer), resize_token_embeddings) and check the "
        f"ids' max; {_GUARD} validates embedding indices before the kernel runs.",
        "op_domain",
    ),
    _p(
        "anomaly_nan_in_backward",
        r"Function '(?P<op>\w+)' returned nan values in its (?P<output>\d+)\w* output",
        "autograd anomaly mode caught {op} producing NaN in the backward pass.",
        "Fix the forward op behind {op} (anomaly mode prints its forward traceback just above).",
        "nonfinite_grad",
    ),
    _p(
        "numpy_overflow",
        r"RuntimeWarning: overflow encountered in (?P<op>\w+)",
        "numpy overflowed to inf in '{op}': usually huge finite values such as masked-array fill values "
        "(1e20, 9.96921e36) leaking through plain numpy ops (np.concatenate, arr.data) and then summed.",
        "Use np.ma functions on masked arrays (np.ma.concatenate) or fill masked entries explicitly "
        f"(arr.filled(0)); {_GUARD}(max_abs_input=...) flags such batches as suspicious_input.",
        "suspicious_input",
    ),
    _p(
        "numpy_invalid_value",
        r"RuntimeWarning: (?:invalid value|divide by zero) encountered in (?P<op>\w+)",
        "numpy produced NaN/inf in '{op}': a division by zero (0/0, a zero std or count) or inf - inf.",
        "Add an eps to denominators ((x - mean) / (std + 1e-8)) or mask empty groups before dividing; "
        f"{_GUARD} reports the batch field that carries the NaN.",
        "nonfinite_input",
    ),
    _p(
        "grad_norm_nonfinite",
        r"The total norm of order \S+ for gradients from `parameters` is non-finite",
        "clip_grad_norm_(error_if_nonfinite=True) found NaN/Inf gradients; clipping cannot repair them.",
        "Find the op whose backward went non-finite (anomaly mode, or the nonfinite_grad events of "
        f"{_GUARD}, which also skips or rolls back the step instead of crashing).",
        "nonfinite_grad",
    ),
    _p(
        "grad_scaler_no_inf_checks",
        r"No inf checks were recorded (?:for this optimizer|prior to update)",
        "GradScaler.step/update found no gradients to check for this optimizer: none of its "
        "parameters received a gradient (frozen or unused layers handed to the optimizer, or the "
        "loss was not passed through scaler.scale before backward).",
        "Give the optimizer only trainable, used parameters (filter by requires_grad) and call "
        f"scaler.scale(loss).backward(); {_GUARD}(check_optimizer_coverage='error') reports the mismatch.",
        "optimizer_coverage",
    ),
    _p(
        "amp_fp16_params",
        r"Attempting to unscale FP16 gradients",
        "the GradScaler found fp16 parameters: the model was cast with .half() while also using AMP.",
        "Keep the master weights in fp32 (no model.half()) and let autocast pick the compute dtype.",
        "nonfinite_grad",
    ),
    _p(
        "loss_scale_collapse",
        r"(?i)current loss scale already at minimum"
        r"|gradient overflow\.\s*skipping step"
        r"|overflow!.*skipping step",
        "the fp16 loss scaler skipped steps for inf gradients; occasional skips are normal, a scale "
        "that keeps falling means the gradients are non-finite at any scale.",
        "Find the op that overflows (its fp16 range is 6.5e4): compute it in fp32 or switch to bf16; "
        f"{_GUARD} counts scaler skips apart from real incidents.",
        "nonfinite_grad",
    ),
    _p(
        "distribution_invalid_parameter",
        r"Expected parameter (?P<param>\w+) .*to satisfy the constraint (?P<constraint>.+?),? "
        r"but found invalid values",
        "a torch.distributions object got an invalid '{param}' (constraint {constraint}): NaN from the "
        "network that predicts it, or a scale/probability outside its range.",
        "Find the module whose output went NaN first; parameterise scales as softplus(x) + eps and "
        f"probabilities via logits. {_LOCATE}",
        "nonfinite_output",
    ),
    _p(
        "loss_nonfinite",
        r"(?i)(?<![a-z])loss\w*['\"]?\s*(?:[=:]|\bis\b|\bwas\b|\bbecame\b|\breturned\b)\s*(?:tensor\()?"
        r"(?:nan|[-+]?inf)\b"
        r"|Monitored metric \S+ = (?:tensor\()?(?:nan|[-+]?inf)\b.* is not finite"
        r"|Detected nan and/or inf values in",
        "the loss (or a monitored metric) became NaN/Inf; the log does not say where it started.",
        f"Rerun with {_GUARD}: it names the first input, module, loss or gradient that went "
        "non-finite, and can skip or roll back the step instead of losing the run.",
        "nonfinite_loss",
    ),
    _p(
        "cuda_kernel_assert",
        r"Assertion `.*` failed",
        "a CUDA kernel's own range check failed: an op got inputs outside its domain (an index out of "
        "range, a probability outside [0, 1]).",
        "The assertion text names the violated condition; the op is in the file name before it "
        f"(Loss.cu, Indexing.cu, ScatterGather.cu). {_GUARD} validates the usual suspects first.",
        "op_domain",
    ),
    _p(
        "cuda_library_error_after_assert",
        r"CUBLAS_STATUS_EXECUTION_FAILED|CUBLAS_STATUS_NOT_INITIALIZED"
        r"|CUDNN_STATUS_EXECUTION_FAILED|CUDNN_STATUS_INTERNAL_ERROR"
        r"|an illegal memory access was encountered",
        "a cuBLAS/cuDNN call failed because the device was already broken, usually by an earlier "
        "device-side assert (an out-of-range index or probability), reported at a later API call; "
        "CUBLAS_STATUS_NOT_INITIALIZED can also mean out of memory.",
        "Look for an earlier 'Assertion ... failed' line: that is the real cause. Rerun with "
        f"CUDA_LAUNCH_BLOCKING=1 for an accurate stack, or with {_GUARD}, which validates op inputs "
        "before the kernel runs.",
        "op_domain",
        follow_on=True,
    ),
    _p(
        "cuda_device_assert",
        r"device-side assert triggered",
        "a CUDA kernel assertion fired; the Python stack trace points at a later, unrelated call "
        "because CUDA reports errors asynchronously.",
        "An earlier 'Assertion ... failed' line in the log is the real cause. Rerun with "
        f"CUDA_LAUNCH_BLOCKING=1 (or on CPU) for an accurate stack, or with {_GUARD}, which validates "
        "op inputs before the kernel runs and names the offending op and step.",
        "op_domain",
        follow_on=True,
    ),
)
"""Every known failure signature, most specific first."""
