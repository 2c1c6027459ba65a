"""After a hit: confirm every candidate exactly and name the culprits, in causal order, on every rank.

Runs only when the step's read saw something; every call here is collective (every rank holds the
same flag vector, so every rank takes the same branches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl

from lightning_numguard.callbacks import _distributed
from lightning_numguard.callbacks._inspector import Reading, StepInspector
from lightning_numguard.callbacks._replay import replay_batch
from lightning_numguard.core import flags
from lightning_numguard.core.findings import Finding, mark_consequences, merge
from lightning_numguard.core.policy import is_amp_overflow

__all__ = ["Diagnosis", "diagnose"]


@dataclass
class Diagnosis:
    """What a hit turned out to be."""

    findings: list[Finding] = field(default_factory=list)
    state_bad: list[str] = field(default_factory=list)
    amp_overflow: bool = False


def diagnose(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    inspector: StepInspector,
    reading: Reading,
    replay: bool,
) -> Diagnosis:
    """The findings of a hit, merged across ranks, in causal order, consequences marked.

    ``replay``: re-run the batch with full instrumentation when the forward or backward pass went
    bad, to name the first module (when outputs are not watched every step) and the first op.
    """
    rec = inspector.record
    assert rec is not None
    seen, rank, world = reading.flags, trainer.global_rank, trainer.world_size
    state_bad, state_rank = inspector.state_bad_where(trainer, reading)
    grad_bad = _distributed.any_rank(trainer, inspector.confirmed(trainer, reading, "grads"))
    buffer_bad = _distributed.any_rank(trainer, inspector.confirmed(trainer, reading, "live_buffers"))
    has_scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
    amp_overflow = is_amp_overflow(
        grads_bad=bool(grad_bad), has_scaler=has_scaler, local_incident=seen.any_local(), state_bad=bool(state_bad)
    )
    if amp_overflow:  # fp16 AMP: non-finite gradients are the GradScaler's business (it skips and backs off)
        grad_bad = []

    # appended in causal order: inputs, state before the step, module outputs, op domains, loss, gradients, buffers
    found: list[Finding] = []
    if seen.seen_on(flags.INPUT, rank, world) or seen.seen_on(flags.SUSPICIOUS, rank, world):
        found.extend(inspector.input_findings(rank))
    for site, names in _by_site(inspector, state_bad):
        details = {"when": "before the optimizer step"}
        found.append(Finding("nonfinite_param", names, details, state_rank, site=site))
    output = inspector.output_finding(rank) if seen.seen(flags.OUTPUT) else None
    if output is not None:
        found.append(output)

    result: dict[str, Any] = {}
    if (
        replay
        and rec.batch is not None
        and (seen.seen(flags.OUTPUT) or seen.seen(flags.OP) or seen.seen(flags.LOSS) or grad_bad)
    ):
        result = _replay(trainer, pl_module, inspector, rec.start_rng)
    stage = result.get("stage")
    sites = result.pop("op_sites", {}) or {}
    forward_culprit = stage == "forward" and result.get("op_module") is not None
    if output is None and result.get("forward_module") and (stage != "forward" or forward_culprit):
        output = Finding("nonfinite_output", [result["forward_module"]], {}, rank)
        found.append(output)
    if output is not None and result.get("forward_module") and result["forward_module"] != output.where[0]:
        # the per-step watch names a block; the replay, watching every module, names the exact one
        output.details["block"] = output.where[0]
        output.where[0] = result["forward_module"]
    if output is not None and forward_culprit and result["op_module"] != output.where[0]:
        # the module that ran the culprit op, not the first one its bad value reached (a fully masked softmax
        # row in `attn` is seen first at the output of `attn.proj`)
        output.details["first_bad_output"] = output.where[0]
        output.where[0] = result["op_module"]
    if output is not None:
        output.details["replay"] = result
        if forward_culprit:
            _name_op(output, result)
    first_module = output.where[0] if output is not None else None

    if seen.seen(flags.OP):
        for finding in inspector.op_findings(first_module, rank):
            op, module = finding.where[0], finding.details.get("module")
            line = sites.get(op) or {}
            finding.where, finding.op, finding.module = [op], op, module
            if line.get("file"):
                finding.source = f"{line['file']}:{line['line']}"
            found.append(finding)
    loss = inspector.loss_finding(rank) if seen.seen_on(flags.LOSS, rank, world) and rec.losses else None
    if loss is not None:
        found.append(loss)
        if result:
            loss.details["replay"] = result
            if stage == "forward" and not forward_culprit:  # an op outside every submodule: the loss code
                _name_op(loss, result)
    if grad_bad:
        grad = Finding("nonfinite_grad", grad_bad, {}, seen.rank(flags.NORMS))
        if result:
            grad.details["replay"] = result
            if stage == "backward":
                _name_op(grad, result)
        found.append(grad)
    if buffer_bad:
        buffers = inspector.buffer_finding(buffer_bad, seen.rank(flags.NORMS))
        buffers.site = "buffer"
        found.append(buffers)
    checked = sorted(set(inspector.check) | ({"replay"} if result else set()))
    for finding in found:
        finding.details["checked"] = checked

    findings = merge(_distributed.gather(trainer, found))  # so that rank 0 can write every rank's findings
    mark_consequences(findings)
    return Diagnosis(findings, state_bad, amp_overflow)


def _name_op(finding: Finding, result: dict[str, Any]) -> None:
    """Put the replay's culprit op, its module and the user's line into ``finding``'s own fields."""
    finding.op = result.get("op")
    finding.module = result.get("op_module") or result.get("module")
    if result.get("file"):
        finding.source = f"{result['file']}:{result['line']}"


def _by_site(inspector: StepInspector, names: list[str]) -> list[tuple[str, list[str]]]:
    """``names`` split into parameters, buffers and optimizer state (one kind of name per event)."""
    params = {n for n, _ in inspector.named_params}
    groups: dict[str, list[str]] = {}
    for name in names:
        site = "optimizer_state" if name.startswith("optimizer[") else "param" if name in params else "buffer"
        groups.setdefault(site, []).append(name)
    return [(site, groups[site]) for site in ("param", "buffer", "optimizer_state") if site in groups]


def _replay(
    trainer: pl.Trainer, pl_module: pl.LightningModule, inspector: StepInspector, rng: dict[str, Any] | None
) -> dict[str, Any]:
    rec = inspector.record
    assert rec is not None
    watch = inspector.watch
    watching = watch.enabled if watch is not None else False
    if watch is not None:
        watch.enabled = False
    try:
        return replay_batch(trainer, pl_module, rec.batch, rec.batch_idx, rng)
    finally:
        if watch is not None:
            watch.enabled = watching
