"""One-sentence messages, shared by warnings, exceptions, events and the CLI; the hints come from :mod:`.hints`.

A message claims only what was checked: ``details["checked"]`` lists the sites checked in the
step (``inputs``, ``outputs``, ``loss``, ..., and ``replay`` when the batch was replayed); a
sentence such as "the inputs were finite" appears only when that site was checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from lightning_numguard.detect import registry
from lightning_numguard.reporting.hints import KIND_HINTS, event_hint, fill_value_name

__all__ = [
    "SENTENCES",
    "action_message",
    "cause_words",
    "incident_message",
    "positions_words",
    "repeat_message",
    "steps_words",
]

_SITE_WORDS = {"param": "parameters", "buffer": "buffers", "optimizer_state": "optimizer state"}


def _names(where: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{w}`" for w in where[:limit])
    if len(where) > limit:
        shown += f" and {len(where) - limit} more"
    return shown


def _op_clause(
    op: str | None, module: str | None, source: str | None, backward: bool = False, inf_in: bool = False
) -> str:
    if not op:
        return ""
    what = "autograd op" if backward else "op"
    values = "values holding ±Inf but no NaN into NaN" if inf_in else "finite values into NaN/Inf"
    text = f"the first {what} to turn {values} was `{op}`"
    if module:
        text += f" in `{module}`"
    if source:
        text += f" at {source}"
    return text


def incident_message(
    kind: str,
    where: Sequence[str],
    details: dict[str, Any],
    step: int,
    rank: int,
    op: str | None = None,
    module: str | None = None,
    site: str | None = None,
    source: str | None = None,
) -> str:
    """The one human sentence of an event: what, where, when, and the likely fix.

    The fix is :func:`~lightning_numguard.reporting.hints.event_hint`, the same advice
    ``numguard explain`` gives for the event; a kind this version does not know gets none.
    ``op``, ``module``, ``site`` and ``source`` are the event's fields of the same names.
    """
    at = f"at step {step} on rank {rank}"
    names = _names(where)
    check = registry.check_of(kind)  # its own sentence when it is no fused check (SENTENCES has those)
    hint = event_hint(kind, details) if kind in KIND_HINTS or check is not None else ""
    checked = set(details.get("checked") or ())
    replay = details.get("replay") or {}
    root = not details.get("after")
    convention = details.get("convention")
    if convention and kind in ("nonfinite_input", "suspicious_input"):
        return _convention_message(kind, names, details, int(convention.get("steps", 0)), at)
    persistent = details.get("persistent")
    if persistent and kind in ("nonfinite_input", "suspicious_input"):
        rest = {k: v for k, v in details.items() if k != "persistent"}
        text = incident_message(kind, where, rest, step, rank, op, module, site, source)
        return text + _persistent_message(kind, names, int(persistent.get("steps", 0)))
    first = where[0] if where else "op"
    say = _Say(kind, names, first, details, at, hint, checked, replay, root, op, module, site, source)
    text = SENTENCES[kind](say) if kind in SENTENCES else check.message(names, details, at) if check else _unknown(say)
    if isinstance(text, _Whole):
        return str(text)
    return f"{text}; {hint}" if hint else text


def _convention_message(kind: str, names: str, details: dict[str, Any], steps: int, at: str) -> str:
    """A batch field flagged on ``steps`` consecutive steps: a convention of the data, no longer acted on."""
    if kind == "suspicious_input":
        value = details.get("max_abs")
        above = f", or a threshold above {value:.6g}" if isinstance(value, (int, float)) else ""
        setting = f"NumGuardCallback(max_abs_input=None{above})"
        what = "held values above max_abs_input"
    else:
        setting = "NumGuardCallback(check=[...]) without 'inputs'"
        what = "held NaN/Inf"
    return (
        f"{names} {what} on {steps} consecutive steps (the last {at}): that is a convention of this data, not "
        f"a fault, so NumGuard no longer checks this field and no longer skips or rolls back steps for it in "
        f"this fit (the module outputs, loss, gradients and weights are still checked every step); "
        f"{setting} silences this"
    )


def _persistent_message(kind: str, names: str, steps: int) -> str:
    """A batch field flagged on ``steps`` consecutive steps with values that are no mask: a broken pipeline."""
    off = "NumGuardCallback(max_abs_input=None)" if kind == "suspicious_input" else "check=[...] without 'inputs'"
    return (
        f". {names} was flagged on {steps} consecutive steps: these values are in every batch, so the data "
        f"pipeline is broken (not one bad batch, and not a mask: only infinities or a dtype's own extremes are "
        f"taken for masks). NumGuard halts rather than skip every step; fix the data (if the model ignores or "
        f"clamps this field on purpose, {off} stops checking it)"
    )


def _restored(step: int, snapshot_step: int | None, lost: int | None = None) -> str:
    """What a rollback put back and what it cost, in words that match what happened (``lost``: the updates it
    discarded, when fewer than the steps since the snapshot)."""
    if snapshot_step is None:
        return ""
    if snapshot_step >= step:  # the state before this step was verified finite by its own check
        return "back to the verified-finite state at the start of this step, so only this batch's update is dropped"
    span = step - snapshot_step
    steps = f"step {snapshot_step}" if span == 1 else f"steps {snapshot_step}-{step - 1}"
    head = f"back to the verified-finite snapshot of step {snapshot_step}:"
    if lost is None or lost >= span:
        return f"{head} the updates of {steps} ({span} step{'s' if span != 1 else ''}) are lost"
    return (
        f"{head} {lost} update{'s' if lost != 1 else ''} made since {'is' if lost == 1 else 'are'} lost (of {steps}, "
        f"the other {span - lost} were skipped or already undone by an earlier rollback)"
    )


def cause_words(root: Mapping[str, Any] | None, op: bool = True) -> str:
    """The root cause of an action in a few words: its kind and place, and (``op``) the culprit op with its line
    (``nonfinite_output in MyVAE (op `exp` at vae.py:26)``)."""
    if not root:
        return "non-finite values"
    text = f"{root['kind']} in {', '.join(root['where'][:3]) or '-'}"
    name, source = root.get("op"), root.get("source")
    if op and name:
        text += f" (op `{name}`" + (f" at {_short_source(str(source))}" if source else "") + ")"
    return text


def _short_source(source: str) -> str:
    """``file.py:26`` of a ``/long/path/file.py:26``."""
    path, sep, line = source.rpartition(":")
    return f"{PurePath(path).name}{sep}{line}" if sep and line.isdigit() else PurePath(source).name


_DONE = {"skip": "skipped the optimizer step", "rollback": "rolled back", "halt": "halted training"}


def action_message(
    action: str,
    configured: str,
    step: int,
    root: dict[str, Any] | None,
    escalation: str | None = None,
    snapshot_step: int | None = None,
    checkpoint: str | None = None,
    events_file: str | None = None,
    steps_lost: int | None = None,
) -> str:
    """The one log line of an action taken: what was done, why, and where the files are.

    Args:
        action: what was done (``skip``, ``rollback``, ``halt``).
        configured: the callback's ``action`` (differs from ``action`` after an escalation).
        step: the global step.
        root: the step's root-cause event, if any.
        escalation: why ``configured`` escalated to ``action``.
        snapshot_step: the step of the finite state restored.
        checkpoint: ``last_finite.ckpt``'s path, when one was written.
        events_file: ``events.jsonl``'s path, when one was written.
        steps_lost: the updates the restore discarded (fewer than the steps since the snapshot when some of them
            were skipped or already undone by an earlier rollback); ``None``: all of them.
    """
    done = _DONE.get(action, f"took action {action!r}")
    text = f"NumGuard {done} at step {step} because of {cause_words(root)}"
    restored = _restored(step, snapshot_step, steps_lost)
    if restored:
        text += f": {restored}"
    if action != configured:
        text += f"; escalated from {configured!r} to {action!r}" + (f": {escalation}" if escalation else "")
    if action == "rollback" and checkpoint:
        text += f"; last finite checkpoint: {checkpoint}"
    if action == "halt":
        text += (
            f"; last finite checkpoint: {checkpoint}"
            if checkpoint
            else "; no last_finite.ckpt was written (no finite snapshot, or no dirpath to write to: "
            "set NumGuardCallback(dirpath=...))"
        )
    text += f"; events: {events_file}" if events_file else "; events are in callback.events (no events.jsonl written)"
    return text + "."


def steps_words(steps: Sequence[int], limit: int = 6) -> str:
    """Steps as a reader counts them: runs of consecutive steps joined (``5-9, 12, 14``), at most ``limit`` runs
    and then how many more steps."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    shown = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" if len(r) > 2 else f"{r[0]}, {r[1]}" for r in runs]
    text = ", ".join(shown[:limit])
    if len(runs) > limit:
        text += f" and {sum(len(r) for r in runs[limit:])} more"
    return text


def repeat_message(action: str, steps: Sequence[int], root: Mapping[str, Any] | None) -> str:
    """The one line of actions that repeated an earlier line's action for the same cause, at ``steps``."""
    done = {"skip": "skipped", "rollback": "rolled back"}.get(action, _DONE.get(action, action))
    times = f"{len(steps)} times, " if len(steps) > 1 else ""
    where = f"step{'s' if len(steps) > 1 else ''} {steps_words(steps)}"
    return f"NumGuard {done} again at {where} ({times}same cause: {cause_words(root, op=False)})."


# --------------------------------------------------------------------------- one sentence per kind


@dataclass(frozen=True)
class _Say:
    """What a kind's sentence is made of (the fields of :func:`incident_message`, prepared once)."""

    kind: str
    names: str
    first: str  # the first place named, or "op"
    details: dict[str, Any]
    at: str
    hint: str
    checked: set[str]
    replay: dict[str, Any]
    root: bool
    op: str | None
    module: str | None
    site: str | None
    source: str | None


class _Whole(str):
    """A sentence complete as it is: no hint is appended."""


def positions_words(path: str, details: Mapping[str, Any]) -> str:
    """Where in the batch, from an input event's details: ``first at batch['x'][3, 7] (sample 3 of 8 in the batch,
    dataset index 27)``; ``""`` when the details hold no positions."""
    positions = [p for p in details.get("positions") or [] if isinstance(p, list)]
    samples = [int(i) for i in details.get("samples") or []]
    if not positions:
        return ""
    text = "first at " + ", ".join(f"{path}[{', '.join(map(str, p))}]" for p in positions)
    raw, total = details.get("bad_samples"), details.get("samples_in_batch")
    bad = raw if isinstance(raw, int) else len(samples)
    which = ", ".join(map(str, samples)) + (f" and {bad - len(samples)} more" if bad > len(samples) else "")
    text += f" (sample{'s' if bad > 1 else ''} {which}"
    text += f" of {total} in the batch" if isinstance(total, int) else " of the batch"
    indices = details.get("sample_indices")
    if indices:
        text += f"; dataset ind{'ices' if len(indices) > 1 else 'ex'} {', '.join(map(str, indices))}"
    return text + ")"


def _reproduction(s: _Say, what: str) -> str | None:
    """The sentence of a root cause whose step was re-run with the same weights, inputs and RNG: when the value did
    not come back (or came back only on its own rank), the truth about it; ``None`` when the replay says nothing of
    the device (the sentence of the kind then stands, with this clause added by :func:`_reproduced_elsewhere`)."""
    if not s.root:
        return None
    fault = s.details.get("device_fault") or {}
    where = f"rank {fault.get('rank')}, host {fault.get('host')}, device {fault.get('device')}"
    if fault.get("verdict") == "transient":
        return (
            f"{what} {s.at}, which did not reproduce when the step was re-run with the same weights, inputs and RNG: "
            f"not a fault of the code or the data; a transient fault of the device — {where}"
        )
    if fault.get("verdict") == "this_rank":
        neighbour = (s.details.get("neighbour") or {}).get("rank", "?")
        traced = f" (op `{s.op}`" if s.op else ""
        traced += (f" in `{s.module}`" if s.module else "") + (f" at {s.source}" if s.source else "")
        traced += ")" if s.op else ""
        return (
            f"{what} {s.at}, again when rank {fault.get('rank')} re-ran the step{traced}, but not when rank "
            f"{neighbour} re-ran the same micro-batch with the same weights and RNG: not a fault of the data; a fault "
            f"of this rank's device, or of code that runs only on this rank — {where}"
        )
    if s.details.get("compiled"):
        return (
            f"{what} {s.at}, which did not reproduce when the step was re-run eagerly with the same weights, inputs "
            "and RNG: the compiled code made it (or the device did)"
        )
    return None


def _reproduced_elsewhere(s: _Say) -> str:
    """What a neighbour's re-run of the same micro-batch adds when it made the value too."""
    neighbour = s.details.get("neighbour") or {}
    if not s.root or not neighbour.get("reproduced"):
        return ""
    return (
        f" (rank {neighbour.get('rank')} re-ran the same micro-batch with the same weights and RNG and made it too: "
        "the data or the code, not the device)"
    )


def _input(s: _Say) -> str:
    text = f"non-finite value in {s.names} {s.at}"
    stats = s.details.get("stats") or {}
    if stats:
        text += f" ({stats.get('nan', 0)} NaN, {stats.get('posinf', 0)} +Inf, {stats.get('neginf', 0)} -Inf)"
    where = positions_words(s.first, s.details)
    return f"{text}, {where}" if where else text


def _suspicious(s: _Say) -> str:
    value = s.details.get("max_abs")
    text = f"suspiciously large finite value {value:.6g} in {s.names} {s.at}" if value else f"huge value in {s.names}"
    where = positions_words(s.first, s.details)
    text += f", {where}" if where else ""
    return _Whole(f"{text}: {s.hint}") if fill_value_name(value) else text


def _output(s: _Say) -> str:
    op, replay, source, module = s.op, s.replay, s.source, s.module
    if s.details.get("received_from"):
        return f"module {s.names} received non-finite values from `{s.details['received_from']}` {s.at}"
    verdict = _reproduction(s, f"module {s.names} produced a non-finite output")
    if verdict is not None:
        return verdict
    return _output_made(s, op, replay, source, module) + _reproduced_elsewhere(s)


def _output_made(s: _Say, op: str | None, replay: dict[str, Any], source: str | None, module: str | None) -> str:
    text = f"module {s.names} produced the first non-finite output {s.at}"
    if s.details.get("own_code"):
        text = f"the LightningModule's own code ({s.names}, outside every submodule) made the first non-finite "
        text += f"value {s.at}"
    written = replay.get("written") or {}
    into = f" into {written.get('source')} `{written.get('name')}`" if written.get("name") else ""
    if op and replay.get("literal"):
        text += f"; replay traced it to op `{op}`" + (f" at {source}" if source else "")
        text += f", writing a NaN/Inf literal{into}"
    elif op and into:
        text += f"; replay traced it to op `{op}`" + (f" at {source}" if source else "") + f", writing{into}"
    elif op:
        # kept word for word from earlier versions: "replay traced it to op `div` in `norm`"
        text += f"; replay traced it to op `{op}`" + (f" in `{module}`" if module else "")
        text += f" at {source}" if source else ""
        text += " from inputs holding ±Inf but no NaN" if replay.get("inf_in") else " from finite inputs"
    elif replay.get("from_another_rank"):
        via = replay.get("first_bad_op")
        text += "; its values came from another rank" + (f" through `{via}`" if via else "")
        text += ", so no op on this rank is to blame"
    elif replay.get("stage") == "inputs":
        text += "; the values entering it were already non-finite, so no op inside it is to blame"
    elif replay.get("error"):
        text += f"; the replay could not run ({replay['error']}), so the module is named from the step's flags"
    return text


def _op_domain(s: _Say) -> str:
    details = s.details
    op_ = s.op or details.get("op", s.first)
    module_ = s.module or details.get("module")
    text = f"`{op_}` got inputs outside its domain ({details.get('rule', '')})"
    if module_:
        text += f" in module `{module_}`"
    text += f" at {s.source}" if s.source else ""
    text += f" {s.at}"
    if details.get("count") is not None:
        text += f": {details['count']} bad values"
        nan = details.get("nan_count") or 0
        lo, hi = details.get("min"), details.get("max")
        numbers = [f"min {lo:.6g}, max {hi:.6g}"] if lo is not None and hi is not None else []
        text += f" ({', '.join(([f'{nan} NaN'] if nan else []) + numbers)})" if nan or numbers else ""
    return text


def _loss(s: _Say) -> str:
    verdict = _reproduction(s, "the loss went non-finite")
    if verdict is not None:
        return verdict
    return _loss_made(s) + _reproduced_elsewhere(s)


def _loss_made(s: _Say) -> str:
    text = f"the loss is non-finite {s.at}"
    if s.op:
        text += "; " + _op_clause(s.op, s.module, s.source, inf_in=bool(s.replay.get("inf_in")))
    elif s.root and s.replay.get("stage") == "inputs":
        text += "; the replay found the forward pass's inputs already non-finite"
    elif s.root and {"inputs", "outputs"} <= s.checked:
        text += "; the batch and every watched module output were finite, so the loss computation went non-finite"
    elif s.root and "inputs" in s.checked:
        text += "; the batch was finite (module outputs were not checked)"
    return text


def _grad(s: _Say) -> str:
    verdict = _reproduction(s, f"the gradient of {s.names} went non-finite")
    if verdict is not None:
        return verdict
    text = f"non-finite gradient in {s.names} {s.at}"
    if s.op:
        text += "; " + _op_clause(s.op, s.module, s.source, backward=True)
        if s.replay.get("stage") == "backward":
            text += " (the replayed forward pass was finite)"
    elif s.root and "loss" in s.checked:
        text += "; the loss was finite, so the backward pass made it"
    return text


def _param(s: _Say) -> str:
    when = s.details.get("when")
    what = _SITE_WORDS.get(s.site or "", "")
    return f"non-finite values in {what + ' ' if what else ''}{s.names} {when + ' ' if when else ''}{s.at}"


def _spike(s: _Say) -> str:
    details = s.details
    what = "the loss" if s.kind == "loss_spike" else "the global gradient norm"
    value, z = details.get("value"), details.get("zscore")
    text = f"{what} spiked to {value:.4g}" if isinstance(value, (int, float)) else f"{what} spiked"
    if isinstance(z, (int, float)):
        text += f", {z:.1f} robust sigma above the median of its last {details.get('window', '?')} steps"
        text += f" (threshold {details.get('sigma', '?')})"
    text += f" {s.at}"
    if details.get("escalated"):
        text += f"; rolled back: {details['escalated']}"
    return text


def _overflow(s: _Say) -> str:
    details = s.details
    if details.get("loss_scale_collapse"):
        return _Whole(str(details["loss_scale_collapse"]))
    peak, limit, dtype = details.get("peak"), details.get("limit"), details.get("dtype", "?")
    if isinstance(peak, (int, float)) and isinstance(limit, (int, float)) and peak > 0:
        return (
            f"module {s.names} output reached |x| = {peak:.5g}, within {limit / peak:.3g}x of {dtype}'s largest "
            f"finite value {limit:.6g}, {s.at}"
        )
    return f"module {s.names} output is near {dtype}'s largest finite value {s.at}"


def _unknown(s: _Say) -> str:
    return f"{s.kind} in {s.names} {s.at}"


#: The sentence of each kind of :data:`~lightning_numguard.reporting.events.KINDS` (a kind not here: ``"<kind> in …"``).
SENTENCES: dict[str, Callable[[_Say], str]] = {
    "nonfinite_input": _input,
    "suspicious_input": _suspicious,
    "nonfinite_output": _output,
    "op_domain": _op_domain,
    "nonfinite_loss": _loss,
    "nonfinite_grad": _grad,
    "nonfinite_param": _param,
    "loss_spike": _spike,
    "grad_norm_spike": _spike,
    "overflow_risk": _overflow,
}
