"""The checks, declared once: each check's event kinds, in causal order, whether they are advisory, and their hint.

``KINDS`` and ``ADVISORY_KINDS`` (:mod:`~lightning_numguard.core.events`), the hint of every kind
(:data:`~lightning_numguard.reporting.hints.KIND_HINTS`) and the README's table of event kinds
(``python -m benchmarks.kinds_table --write README.md``) are derived from :data:`CHECKS`; nothing else lists them.

The order of :data:`CHECKS` is the causal order of a step: the order findings of one step are recorded in, so the
first is the root cause (a check whose kind is reported later in the step comes later here).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CHECKS", "Check", "advisory_kinds", "kind_hints", "kinds", "kinds_table"]


@dataclass(frozen=True)
class Check:
    """One check of a training step, and the event kind its findings carry."""

    #: what is checked, in words
    name: str
    #: the event kind of its findings
    kind: str
    #: what went bad when it fires (one cell of the README's table)
    what: str
    #: the hint, in short (one cell of the README's table)
    short_hint: str
    #: the one sentence of advice every event of this kind carries (``reporting/hints``)
    hint: str
    #: advisory: it warns ahead of trouble, is never counted as an incident nor acted on
    advisory: bool = False


CHECKS: tuple[Check, ...] = (
    Check(
        "optimizer coverage",
        "optimizer_coverage",
        "trainable parameters in no optimizer, frozen ones in one, parameters in two groups or without gradients",
        "build the optimizer from the trainable parameters",
        "build the optimizer from `[p for p in model.parameters() if p.requires_grad]` and give every trainable "
        "parameter exactly one param group",
        advisory=True,
    ),
    Check(
        "batch inputs",
        "nonfinite_input",
        "a floating tensor of the batch holds NaN/Inf",
        "the data is bad before the model sees it",
        "the data is bad before the model sees it: check the dataset/transforms for NaN (missing values, log(0), "
        "0/0) and clean or drop those samples",
    ),
    Check(
        "suspicious inputs",
        "suspicious_input",
        "finite batch values `>= max_abs_input` (`1e20`, `9.96921e36` fill values; a dtype's own extreme, "
        "`torch.finfo(dtype).min` in an additive attention mask, is a mask, not one)",
        "mask or clip them in the data pipeline",
        "finite values this large overflow in the first layers; mask or clip them in the data pipeline",
    ),
    Check(
        "parameters, buffers and optimizer state",
        "nonfinite_param",
        "weights, buffers (BatchNorm statistics) or optimizer state",
        "an earlier bad update; the guard restores the last finite state",
        "the weights themselves are no longer finite (an earlier bad update, or the optimizer state): restore a "
        "finite state and lower the learning rate",
    ),
    Check(
        "module outputs",
        "nonfinite_output",
        "the first module whose output went non-finite (the module that ran the culprit op, when the replay names one)",
        "a division by a zero std, sqrt/log of 0; a fully masked softmax row",
        "look in this module for division by a zero std, sqrt/log of 0 or negatives, exp overflow; add an eps or clamp",
    ),
    Check(
        "overflow headroom",
        "overflow_risk",
        "a watched block's output within `overflow_headroom` (8x) of its dtype's largest value, or a collapsing "
        "fp16 loss scale (advisory, once per block, never counted or acted on)",
        "run that block in float32, scale it down, or train in bf16",
        "run this block in float32 (wrap it in torch.autocast(device_type, enabled=False) and cast its input with "
        ".float()), scale its inputs or weights down (a normalisation, a smaller init), or train in bf16-mixed, "
        "whose range is float32's",
        advisory=True,
    ),
    Check(
        "op domains",
        "op_domain",
        "an op's input outside its domain (BCE probability outside [0, 1], an index out of range)",
        "would have been a device-side assert; refused and named",
        "an op received inputs outside its domain and would have tripped a device-side assert (BCE input outside "
        "[0, 1], class index >= n_classes, embedding index out of range); fix the values feeding that op (often an "
        "upstream NaN, or a label/vocabulary off by one)",
    ),
    Check(
        "loss",
        "nonfinite_loss",
        "the loss, while inputs and outputs were finite",
        "use the numerically stable form of the loss",
        "compute the loss in its numerically stable form (BCEWithLogitsLoss, log_softmax + nll_loss, logsumexp) or "
        "add an eps where it divides or takes a log",
    ),
    Check(
        "loss spikes",
        "loss_spike",
        "the loss, finite but far above its recent range (`spike_action`)",
        "a bad batch or a too-large update: look at this batch, lower the learning rate",
        "a bad batch or an update that went too far: look at this batch, and if spikes repeat lower the learning "
        "rate, lengthen its warm-up or clip gradients (Trainer(gradient_clip_val=1.0))",
    ),
    Check(
        "gradients",
        "nonfinite_grad",
        "the backward pass, while the forward was finite",
        "a sqrt/pow/norm at 0 in the backward",
        "look for a sqrt/pow/norm at 0 or a division by a small number, whose gradient is infinite; add an eps, or "
        "lower the learning rate",
    ),
    Check(
        "gradient-norm spikes",
        "grad_norm_spike",
        "the global gradient norm, finite but far above its recent range (`spike_action`)",
        "clip gradients, lower the learning rate",
        "clip gradients (Trainer(gradient_clip_val=1.0)), lower the learning rate, or look at this batch for outliers",
    ),
)


def kinds(checks: Iterable[Check] = CHECKS) -> tuple[str, ...]:
    """The event kinds of ``checks``, in causal order."""
    return tuple(c.kind for c in checks)


def advisory_kinds(checks: Iterable[Check] = CHECKS) -> tuple[str, ...]:
    """The kinds that warn ahead of trouble and are not counted as incidents."""
    return tuple(c.kind for c in checks if c.advisory)


def kind_hints(checks: Iterable[Check] = CHECKS) -> dict[str, str]:
    """The hint of each kind."""
    return {c.kind: c.hint for c in checks}


def kinds_table(checks: Iterable[Check] = CHECKS) -> str:
    """The README's table of event kinds, one row per kind in causal order."""
    lines = ["| kind | what went bad | the hint, in short |", "|---|---|---|"]
    lines += [f"| `{c.kind}` | {c.what} | {c.short_hint} |" for c in checks]
    return "\n".join(lines)
