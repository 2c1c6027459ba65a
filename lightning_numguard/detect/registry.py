"""The checks, declared once: each check's event kind, causal place, advisory or not, hint, sentence and behaviour.

``KINDS`` and ``ADVISORY_KINDS`` (:mod:`~lightning_numguard.reporting.events`), the hint of every kind
(:data:`~lightning_numguard.reporting.hints.KIND_HINTS`) and the README's table of event kinds
(``python -m benchmarks.kinds_table --write README.md``) are derived from :data:`CHECKS`; the one other table keyed
by kind is the fused kinds' sentences (:data:`~lightning_numguard.reporting.messages.SENTENCES`, which a test holds
to the fused checks of :data:`CHECKS`).

The order of :data:`CHECKS` is the causal order of a step: the order findings of one step are recorded in, so the
first is the root cause (a check whose kind is reported later in the step comes later here).

A check that is not one of the fused reductions is one subclass of :class:`Check` in one file (what a check is:
:mod:`~lightning_numguard.detect.check`): where it records and what 0-d device value it folds into the step's packed
read, or what it finds on the host once per fit; how its findings are built; its arguments (its constructor,
validated there) and its sentence (:meth:`Check.message`). A built-in one is listed once, in :data:`DEFAULTS`
(enabled by default; :meth:`Check.for_fit` builds it from the guard's config), and its instance in :data:`CHECKS`
gives its place in the causal order. A user's is passed as ``NumGuardCallback(extra_checks=[...])``, which
registers it (:func:`register`). The step's one read, the judge, the events, the hints and the docs' tables then
treat both like the fused checks (``ARCHITECTURE.md``, "Adding a check").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_numguard.detect.check import HOOKS, HOST_HOOKS, Check, CheckStep, Hook
from lightning_numguard.detect.coverage_check import OptimizerCoverage
from lightning_numguard.errors import NumGuardConfigError

__all__ = [
    "CHECKS",
    "CHECK_BY_KIND",
    "DEFAULTS",
    "HOOKS",
    "HOST_HOOKS",
    "SITES",
    "Check",
    "CheckStep",
    "Hook",
    "advisory_kinds",
    "arguments_table",
    "check_of",
    "fit_checks",
    "is_advisory",
    "kind_hints",
    "kinds",
    "kinds_table",
    "known",
    "position",
    "register",
]


#: The built-in checks that are not fused reductions: each a :class:`Check` subclass in one file, enabled by default
#: (:meth:`Check.for_fit` builds a fit's instance from the guard's config, ``None`` where the config turns it off).
DEFAULTS: tuple[type[Check], ...] = (OptimizerCoverage,)

CHECKS: tuple[Check, ...] = (
    OptimizerCoverage(),
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
        placeholder="a watched module",
    ),
    Check(
        "overflow headroom",
        "overflow_risk",
        "a watched block's output within `spikes.overflow_headroom` (8x) of its dtype's largest value, or a collapsing "
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
        placeholder="a guarded op",
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
        placeholder="a gradient",
    ),
    Check(
        "gradient-norm spikes",
        "grad_norm_spike",
        "the global gradient norm, finite but far above its recent range (`spike_action`)",
        "clip gradients, lower the learning rate",
        "clip gradients (Trainer(gradient_clip_val=1.0)), lower the learning rate, or look at this batch for outliers",
    ),
)


#: The built-in checks by kind.
CHECK_BY_KIND: Mapping[str, Check] = {c.kind: c for c in CHECKS}


@dataclass(frozen=True)
class Site:
    """One site of ``check=[...]``: the slot of the packed read its values fold into (``detect/flags.SLOTS``) and the
    event kinds its findings carry."""

    slot: str
    kinds: tuple[str, ...]


#: The one map between the three names of what a step checks: a *site* is what ``check=[...]`` names, a *slot* is
#: where its values go in the step's one packed read, a *kind* is what its events are called.
SITES: Mapping[str, Site] = {
    "inputs": Site("input", ("nonfinite_input", "suspicious_input")),
    "outputs": Site("output", ("nonfinite_output", "overflow_risk")),
    "ops": Site("op", ("op_domain",)),
    "loss": Site("loss", ("nonfinite_loss",)),
    "grads": Site("norms", ("nonfinite_grad",)),
    "buffers": Site("norms", ("nonfinite_param",)),
    "params": Site("norms", ("nonfinite_param",)),
    "optimizer_state": Site("norms", ("nonfinite_param",)),
}
#: The checks passed to ``NumGuardCallback(extra_checks=...)`` in this process, by kind (:func:`register`).
_REGISTERED: dict[str, Check] = {}


def register(check: Check) -> Check:
    """Make ``check``'s kind known to the events, hints, sentences and causal order of this process.

    Raises ``NumGuardConfigError`` for a check that does not declare what a check must, or whose kind is a built-in
    kind or another class's. Registering a check of the same class again replaces it (its arguments may differ).
    """
    if not isinstance(check, Check) or check.builtin or (check.records_at is None and not check.looks_at_fit):
        raise NumGuardConfigError(
            f"`extra_checks` takes instances of lightning_numguard.Check subclasses with `records_at` set to one of "
            f"{list(HOOKS)}, or overriding one of {list(HOST_HOOKS)}, got {check!r}"
        )
    name = type(check).__name__
    if check.records_at is not None and check.records_at not in HOOKS:
        raise NumGuardConfigError(f"{name}.records_at must be one of {list(HOOKS)}, got {check.records_at!r}")
    if check.seen_when not in ("positive", "nonfinite"):
        raise NumGuardConfigError(f"{name}.seen_when must be 'positive' or 'nonfinite', got {check.seen_when!r}")
    for attr in ("name", "kind", "what", "short_hint", "hint"):
        if not isinstance(getattr(check, attr), str) or not getattr(check, attr):
            raise NumGuardConfigError(f"{name}.{attr} must be a non-empty string: every check declares it")
    builtin = kinds()
    if check.kind in builtin:
        raise NumGuardConfigError(f"{name}.kind {check.kind!r} is a built-in kind: give the check its own kind")
    if check.after is not None and check.after not in builtin + tuple(_REGISTERED):
        raise NumGuardConfigError(f"{name}.after must be a known kind or None, got {check.after!r}")
    old = _REGISTERED.get(check.kind)
    if old is not None and type(old) is not type(check):
        raise NumGuardConfigError(
            f"{name}.kind {check.kind!r} is already the kind of {type(old).__name__}: give each check its own kind"
        )
    _REGISTERED[check.kind] = check
    return check


def known(extra: Iterable[Check] = ()) -> tuple[Check, ...]:
    """The built-in checks with ``extra`` and every registered check, in causal order (each after its ``after``)."""
    out = list(CHECKS)
    for check in [*_REGISTERED.values(), *extra]:
        if any(c.kind == check.kind for c in out):
            continue
        at = next((i + 1 for i, c in enumerate(out) if c.kind == check.after), len(out))
        while check.after is not None and at < len(out) and not out[at].builtin and out[at].after == check.after:
            at += 1  # after the checks registered earlier at the same place
        out.insert(at, check)
    return tuple(out)


def fit_checks(config: Any) -> tuple[Check, ...]:
    """The checks of a fit of ``config`` beside the fused ones: the enabled :data:`DEFAULTS`, then
    ``config.extra_checks``."""
    enabled = (cls.for_fit(config) for cls in DEFAULTS)
    return (*(c for c in enabled if c is not None), *(config.extra_checks or ()))


def check_of(kind: str) -> Check | None:
    """The check (built in or registered) whose findings carry ``kind``, or ``None``."""
    return CHECK_BY_KIND.get(kind) or _REGISTERED.get(kind)


def position(kind: str) -> int:
    """Where ``kind`` comes in a step's causal order (a kind no check declares: after all of them)."""
    order = kinds(known())
    return order.index(kind) if kind in order else len(order)


def is_advisory(kind: str) -> bool:
    """Whether ``kind`` warns ahead of trouble (never counted as an incident nor acted on)."""
    check = check_of(kind)
    return check is not None and check.advisory


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


def arguments_table(checks: Iterable[Check]) -> str:
    """A table of the checks that are not built in: kind, where each records, and its arguments with their values."""
    lines = ["| check | kind | records at | arguments |", "|---|---|---|---|"]
    for c in checks:
        if not c.builtin:
            args = ", ".join(f"`{k}={v!r}`" for k, v in c.arguments().items()) or "none"
            at = f"`{c.records_at}`" if c.records_at is not None else "once per fit (host)"
            lines.append(f"| `{type(c).__name__}`: {c.name} | `{c.kind}` | {at} | {args} |")
    return "\n".join(lines)
