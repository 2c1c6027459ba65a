"""After a hit: the one builder of a step's findings, for both read schedules, on every rank.

:func:`diagnose` confirms every candidate exactly and names the culprits in causal order, merged across ranks
with consequences marked. Read at the step (``sync_mode="every_step"``) it looks at the live instruments,
gradients and buffers, and may replay the batch to name the exact module and op; read one step late
(``sync_mode="deferred"``) it looks at the records kept for that step (:meth:`StepRecorder.keep
<lightning_numguard.engine.record.StepRecorder.keep>`) and the state now, and a slot whose place no rank
can name any more is reported by its flag. Every call here is collective (every rank holds the same flag
vector, so every rank takes the same branches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_numguard.decide.policy import is_amp_overflow
from lightning_numguard.detect import checks, flags, registry
from lightning_numguard.detect import extra as _extra
from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.diagnose.findings import AFTER_FORWARD, Finding, mark_consequences, merge
from lightning_numguard.diagnose.rerun import replay_batch
from lightning_numguard.engine import group as _distributed
from lightning_numguard.engine.read import Reading, StepRead
from lightning_numguard.engine.record import StepRecord, StepRecorder

__all__ = ["Diagnosis", "StepView", "diagnose"]

#: The finding of a slot whose place no rank could name (read late: the records are gone).
_PLACEHOLDERS = {
    slot: (kind, registry.CHECK_BY_KIND[kind].placeholder)
    for slot, kind in ((flags.OUTPUT, "nonfinite_output"), (flags.OP, "op_domain"))
}


@dataclass
class StepView:
    """What the builder looks at: a step's record and read, and (read late) the records kept for it."""

    rec: StepRecord
    reading: Reading
    #: read late: the watch's kept buffer and the op guard's records of that step; ``None``: the live instruments
    kept: tuple[Any, list[Any]] | None = None
    #: read late: the parts of the ``NORMS`` slot (``"grads"``, ``"live_buffers"``, ...) and their totals then
    norms: tuple[list[str], torch.Tensor] | None = None


@dataclass
class Diagnosis:
    """What a hit turned out to be."""

    findings: list[Finding] = field(default_factory=list)
    state_bad: list[str] = field(default_factory=list)
    amp_overflow: bool = False


def diagnose(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    recorder: StepRecorder,
    reader: StepRead,
    view: StepView,
    replay: bool,
    exact_state: bool = True,
) -> Diagnosis:
    """The findings of a hit, merged across ranks, in causal order, consequences marked.

    ``replay``: re-run the batch with full instrumentation when the forward or backward pass went bad, to name
    the first module (when outputs are not watched every step) and the first op (read at the step only).
    ``exact_state``: read late, look at the whole state exactly (``False`` under ``action="warn"``, which
    acts on nothing).
    """
    rec, seen = view.rec, view.reading.flags
    rank, world = trainer.global_rank, trainer.world_size
    late = view.kept is not None
    watch_kept, op_records = view.kept if view.kept is not None else (None, _live_ops(recorder))
    grad_bad: list[str] = []
    buffer_bad: list[str] = []
    amp_overflow = False
    if late:  # the step's gradients and buffers are gone; the state now is what a rollback would judge
        state_bad: list[str] = []
        state_rank = -1
        if exact_state:
            named = reader.state(trainer, with_optimizer=True)
            bad = [n for (n, _), b in zip(named, checks.confirm_nonfinite([t for _, t in named])) if b]
            state_bad, state_rank = _distributed.first_rank(trainer, bad)
    else:
        state_bad, state_rank = reader.state_bad_where(trainer, view.reading)
        grad_bad = _distributed.any_rank(trainer, reader.confirmed(trainer, view.reading, "grads"))
        buffer_bad = _distributed.any_rank(trainer, reader.confirmed(trainer, view.reading, "live_buffers"))
        has_scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        amp_overflow = is_amp_overflow(
            grads_bad=bool(grad_bad), has_scaler=has_scaler, local_incident=seen.any_local(), state_bad=bool(state_bad)
        )
        if amp_overflow:  # fp16 AMP: non-finite gradients are the GradScaler's business (it skips and backs off)
            grad_bad = []

    # appended in causal order: inputs, state before the step, module outputs, op domains, loss, gradients, buffers
    found: list[Finding] = []
    if seen.seen_on(flags.INPUT, rank, world) or seen.seen_on(flags.SUSPICIOUS, rank, world):
        found.extend(input_findings(rec, reader.max_abs_input, rank))
    if late and state_bad:  # the state now, one step after the fault
        found.append(Finding("nonfinite_param", state_bad, {}, state_rank))
    for site, names in _by_site(reader, state_bad) if not late else []:
        found.append(Finding("nonfinite_param", names, {"when": "before the optimizer step"}, state_rank, site=site))
    output = output_finding(recorder.watch, watch_kept, late, rank) if seen.seen(flags.OUTPUT) else None
    if output is not None:
        found.append(output)

    result: dict[str, Any] = {}
    if (
        replay
        and not late
        and rec.batch is not None
        and (seen.seen(flags.OUTPUT) or seen.seen(flags.OP) or seen.seen(flags.LOSS) or grad_bad)
    ):
        result = _replay(trainer, pl_module, recorder, rec)
    stage = result.get("stage")
    sites = result.pop("op_sites", {}) or {}
    if output is None and result.get("forward_module") and stage != "forward":
        output = Finding("nonfinite_output", [result["forward_module"]], {}, rank)
        found.append(output)
    culprit = _culprit_finding(result, output, type(pl_module).__name__, rank) if stage == "forward" else None
    if culprit is not None:  # the op that made the value, where it ran; the module that showed it received it
        if output is not None and output in found:
            found.insert(found.index(output), culprit)
        else:
            found.append(culprit)
        if output is not None and _inside(culprit.where[0], output.where[0]):  # the block that made it
            found.remove(output)
            culprit.details.update({k: v for k, v in output.details.items() if k not in culprit.details})
            output = None  # one event: the culprit's
        elif output is not None:
            output.details["received_from"] = culprit.where[0]
    elif output is not None and result.get("forward_module") and result["forward_module"] != output.where[0]:
        # the per-step watch names a block; the replay, watching every module, names the exact one
        output.details["block"] = output.where[0]
        output.where[0] = result["forward_module"]
    for shown in (culprit, output):
        if shown is not None and not late:
            shown.details["replay"] = result
    shown_first = culprit or output
    first_module = shown_first.where[0] if shown_first is not None else None

    if seen.seen(flags.OP):
        for finding in op_findings(op_records, first_module, rank, late):
            op, module = finding.where[0], finding.details.get("module")
            calls = sites.get(op) or []
            line = calls[min(finding.details.pop("call", 0), len(calls) - 1)] if calls else {}
            if not late:
                finding.where, finding.op, finding.module = [op], op, module
            if line.get("file"):
                finding.source = f"{line['file']}:{line['line']}"
            found.append(finding)
    loss = loss_finding(rec, rank) if seen.seen_on(flags.LOSS, rank, world) and rec.losses else None
    if loss is not None:
        found.append(loss)
        if result:
            loss.details["replay"] = result
            if stage == "forward" and culprit is None:  # no module output went bad: the loss code made it
                _name_op(loss, result)
    if recorder.extra_checks:  # the checks passed as extra_checks, each by its own findings
        found.extend(_extra.findings(recorder.extra_checks, seen, rec.check_step, rec.checks, rank, world, late))
    if grad_bad:
        grad = Finding("nonfinite_grad", grad_bad, {}, seen.rank(flags.NORMS))
        if result:
            grad.details["replay"] = result
            if stage == "backward":
                _name_op(grad, result)
        found.append(grad)
    if buffer_bad:
        buffers = Finding("nonfinite_param", buffer_bad, {"when": AFTER_FORWARD}, seen.rank(flags.NORMS), site="buffer")
        found.append(buffers)
    if not late:
        checked = sorted(set(reader.check) | ({"replay"} if result else set()))
        for finding in found:
            finding.details["checked"] = checked

    findings = merge(_distributed.gather(trainer, found))  # so that rank 0 can write every rank's findings
    if late:
        findings = _placeholders(seen, findings, view.norms)
    mark_consequences(findings)
    return Diagnosis(findings, state_bad, amp_overflow)


def _placeholders(
    seen: flags.StepFlags, findings: list[Finding], norms: tuple[list[str], torch.Tensor] | None = None
) -> list[Finding]:
    """Read late, a slot seen on some rank whose place no rank could name is reported by its flag (the ``NORMS``
    slot by the part of it that went bad, from its kept totals: a gradient, a buffer, a parameter...)."""
    kinds = {f.kind for f in findings}
    out = list(findings)
    for slot in (flags.OUTPUT, flags.OP):
        kind, where = _PLACEHOLDERS[slot]
        if seen.seen(slot) and kind not in kinds:
            out.append(Finding(kind, [where], {}, seen.rank(slot)))
    if not out and seen.seen(flags.NORMS):
        out.append(_norms_placeholder(norms, seen.rank(flags.NORMS)))
    return merge([out])


#: The finding of each part of the ``NORMS`` slot read late: kind, what it names, site and details.
_NORM_PARTS: dict[str, tuple[str, str, str | None, dict[str, Any]]] = {
    "grads": ("nonfinite_grad", registry.CHECK_BY_KIND["nonfinite_grad"].placeholder, None, {}),
    "live_buffers": ("nonfinite_param", "a buffer", "buffer", {"when": AFTER_FORWARD}),
    "start_buffers": ("nonfinite_param", "a buffer", "buffer", {}),
    "params": ("nonfinite_param", "a parameter", "param", {}),
    "opt_state": ("nonfinite_param", "the optimizer state", "optimizer_state", {}),
}


def _norms_placeholder(norms: tuple[list[str], torch.Tensor] | None, rank: int) -> Finding:
    """The first part of the ``NORMS`` slot whose kept total is non-finite (a host read, after a hit only)."""
    part = "grads"
    if norms is not None:
        names, totals = norms
        bad = [n for n, v in zip(names, totals.reshape(-1).tolist()) if not math.isfinite(v)]
        part = bad[0] if bad and bad[0] in _NORM_PARTS else part
    kind, where, site, details = _NORM_PARTS[part]
    return Finding(kind, [where], dict(details), rank, site=site)


# ------------------------------------------------------------------ the findings of each site (sync; after a hit)


def input_findings(rec: StepRecord, max_abs_input: float | None, rank: int) -> list[Finding]:
    """Non-finite and suspiciously large batch values, per micro-batch."""
    out: list[Finding] = []
    for leaves, _ in rec.inputs:
        paths = [p for p, _ in leaves]
        values = checks.max_abs([t for _, t in leaves]).tolist()  # exact, per tensor: after a hit only
        nonfinite = [p for p, v in zip(paths, values) if not math.isfinite(v)]
        if nonfinite:
            stats = checks.tensor_stats(dict(leaves)[nonfinite[0]])
            out.append(Finding("nonfinite_input", nonfinite, {"stats": stats}, rank))
        if max_abs_input is not None:
            unmasked = checks.max_abs([t for _, t in leaves], masks_as_zero=True).tolist()  # finfo.min: a mask
            huge = [(p, v) for p, v in zip(paths, unmasked) if math.isfinite(v) and v >= max_abs_input]
            if huge:
                details = {"max_abs": huge[0][1], "threshold": max_abs_input}
                out.append(Finding("suspicious_input", [p for p, _ in huge], details, rank))
    return out


def output_finding(watch: Any, kept: Any, late: bool, rank: int) -> Finding | None:
    """The first watched module whose output went non-finite (``kept``: the records of a past step)."""
    if watch is None or (late and kept is None):
        return None
    bad_modules = watch.first_bad(kept)
    if not bad_modules:
        return None
    first, max_abs = bad_modules[0]
    return Finding("nonfinite_output", [first], {"max_abs": max_abs, "also": [m for m, _ in bad_modules[1:6]]}, rank)


def op_findings(records: list[Any], first_module: str | None, rank: int, late: bool = False) -> list[Finding]:
    """Op calls whose inputs were outside their domain."""
    if not records:
        return []
    device = records[0].flag.device  # one stack on the flags' device, one read (not a read per record)
    values = torch.stack([r.flag.detach().to(device, torch.float32).reshape(()) for r in records]).tolist()
    out: list[Finding] = []
    calls: dict[str, int] = {}
    for record, flag in zip(records, values):
        call = calls.get(record.op, 0)
        calls[record.op] = call + 1
        if flag:
            details = {**OpGuard.describe(record), "call": call}
            if first_module and not late:
                details["upstream"] = first_module
            out.append(Finding("op_domain", [record.op] + ([record.module] if record.module else []), details, rank))
    return out


def loss_finding(rec: StepRecord, rank: int) -> Finding | None:
    """The non-finite loss values of the step's micro-batches."""
    values = [float(x.float().mean()) for x in rec.losses]
    if any(not math.isfinite(v) for v in values):
        return Finding("nonfinite_loss", ["loss"], {"values": values}, rank)
    return None


def _live_ops(recorder: StepRecorder) -> list[Any]:
    return recorder.opguard.records if recorder.opguard is not None else []


def _culprit_finding(result: dict[str, Any], output: Finding | None, root: str, rank: int) -> Finding | None:
    """The root cause of a forward culprit that reached a module's output: ``nonfinite_output`` in the module that
    ran the op (``root``, the LightningModule's class name, for its own ``forward`` or ``training_step``).

    ``None`` when no module output went non-finite (the loss code made the value: the loss finding names it).
    """
    if output is None and not result.get("forward_module") and not result.get("op_module"):
        return None
    module = result.get("op_module") or root
    finding = Finding("nonfinite_output", [module], {"own_code": True} if not result.get("op_module") else {}, rank)
    _name_op(finding, result)
    finding.module = module
    if output is not None and module != output.where[0] and _inside(module, output.where[0]):
        finding.details["block"] = output.where[0]
    return finding


def _inside(module: str, block: str) -> bool:
    """Whether ``module`` is ``block`` or one of its submodules (by qualified name)."""
    return module == block or module.startswith(block + ".")


def _name_op(finding: Finding, result: dict[str, Any]) -> None:
    """Put the replay's culprit op, its module and the user's line into ``finding``'s own fields."""
    finding.op = result.get("op")
    finding.module = result.get("op_module") or result.get("module")
    if result.get("file"):
        finding.source = f"{result['file']}:{result['line']}"


def _by_site(reader: StepRead, names: list[str]) -> list[tuple[str, list[str]]]:
    """``names`` split into parameters, buffers and optimizer state (one kind of name per event)."""
    params = {n for n, _ in reader.named_params}
    groups: dict[str, list[str]] = {}
    for name in names:
        site = "optimizer_state" if name.startswith("optimizer[") else "param" if name in params else "buffer"
        groups.setdefault(site, []).append(name)
    return [(site, groups[site]) for site in ("param", "buffer", "optimizer_state") if site in groups]


def _replay(
    trainer: pl.Trainer, pl_module: pl.LightningModule, recorder: StepRecorder, rec: StepRecord
) -> dict[str, Any]:
    rng = rec.start_rng
    watch = recorder.watch
    watching = watch.enabled if watch is not None else False
    if watch is not None:
        watch.enabled = False
    try:
        return replay_batch(trainer, pl_module, rec.batch, rec.batch_idx, rng)
    finally:
        if watch is not None:
            watch.enabled = watching
