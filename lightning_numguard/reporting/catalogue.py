"""Known NaN/Inf failure signatures in the logs of runs without the guard.

``CATALOGUE`` lists what a run *without* the guard prints when it dies of a non-finite
value: each :class:`Pattern` names the log line that gives the failure away, its usual
cause, the fix, and the incident kind under which ``NumGuardCallback`` would have recorded
it first. The list is in severity order, most specific first: a log line is attributed to
the first entry that matches it (so a BCE assertion is never also reported as a generic
kernel assertion). Entries marked ``follow_on`` are errors that only ever follow another
failure (cuBLAS/cuDNN errors after a device-side assert), so they never outrank a cause.

The advice per incident kind and per autograd op is not here but in :mod:`.hints`, the one
source of hint text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ASSERTION", "CATALOGUE", "DEVICE_ASSERT_OPS", "Pattern"]

_GUARD = "NumGuardCallback"


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
        fix_without_assertion: the fix when the log holds no ``Assertion ... failed`` line (a
            follow-on error whose usual fix points at that line); empty: ``fix`` always applies.
    """

    name: str
    regex: re.Pattern[str]
    cause: str
    fix: str
    hint_kind: str
    follow_on: bool = False
    fix_without_assertion: str = ""


def _p(
    name: str, regex: str, cause: str, fix: str, hint_kind: str, *, follow_on: bool = False, alone: str = ""
) -> Pattern:
    return Pattern(name, re.compile(regex), cause, fix, hint_kind, follow_on, alone)


#: A CUDA kernel's own range check, as the kernel prints it (on the process's stderr).
ASSERTION = re.compile(r"Assertion `.*` failed")

#: Ops whose CUDA kernels assert on bad inputs, as a traceback line names them, and the entry of their assertion:
#: a log with ``device-side assert triggered`` but no assertion line is explained by the op its traceback ends in.
DEVICE_ASSERT_OPS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bbinary_cross_entropy\b|\bBCELoss\b"), "bce_input_range"),
    (re.compile(r"\b(?:nll_loss\w*|cross_entropy)\b|\b(?:NLLLoss|CrossEntropyLoss)\b"), "class_index_out_of_bounds"),
    (re.compile(r"\b(?:embedding|index_select)\b"), "embedding_index_out_of_range"),
)

_RERUN = (
    "Rerun with CUDA_LAUNCH_BLOCKING=1 (or on CPU) for an accurate stack, or with "
    f"{_GUARD}, which validates op inputs before the kernel runs and names the offending op and step."
)
_NO_ASSERTION = (
    "This log holds no 'Assertion ... failed' line (CUDA kernels print it on the process's stderr, which "
    "was not captured here)."
)


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
        alone=f"{_NO_ASSERTION} {_RERUN}",
    ),
    _p(
        "cuda_device_assert",
        r"device-side assert triggered",
        "a CUDA kernel assertion fired; the Python stack trace may point at a later call than the one that "
        "failed, because CUDA reports errors asynchronously.",
        "An earlier 'Assertion ... failed' line in the log is the real cause. Rerun with "
        f"CUDA_LAUNCH_BLOCKING=1 (or on CPU) for an accurate stack, or with {_GUARD}, which validates "
        "op inputs before the kernel runs and names the offending op and step.",
        "op_domain",
        follow_on=True,
        alone=f"{_NO_ASSERTION} {_RERUN}",
    ),
)
"""Every known failure signature, most specific first."""
