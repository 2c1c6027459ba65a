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
    state_bad = inspector.state_bad(trainer, reading)
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
    if state_bad:
        found.append(
            Finding("nonfinite_param", state_bad, {"when": "before the optimizer step"}, seen.rank(flags.NORMS))
        )
    output = inspector.output_finding(rank) if seen.seen(flags.OUTPUT) else None
    if output is not None:
        found.append(output)
    first_module = output.where[0] if output is not None else None

    if (
        replay
        and rec.batch is not None
        and (seen.seen(flags.OUTPUT) or seen.seen(flags.OP) or seen.seen(flags.LOSS) or grad_bad)
    ):
        result = _replay(trainer, pl_module, inspector, rec.start_rng)
        if output is not None and result.get("forward_module") and result["forward_module"] != first_module:
            # the per-step watch names a block; the replay, watching every module, names the exact one
            output.details["block"] = first_module
            output.where[0] = first_module = result["forward_module"]
        if first_module is None and result.get("forward_module"):
            first_module = result["forward_module"]
            op = result.get("forward_op")
            found.append(Finding("nonfinite_output", [first_module] + ([op] if op else []), {"replay": result}, rank))
        for f in found:
            if f.kind == "nonfinite_output" and "replay" not in f.details:
                f.details["replay"] = result
                op = result.get("forward_op") or result.get("op")
                if op and op not in f.where:
                    f.where.append(op)
    else:
        result = {}

    if seen.seen(flags.OP):
        found.extend(inspector.op_findings(first_module, rank))
    if seen.seen_on(flags.LOSS, rank, world) and rec.losses:
        loss = inspector.loss_finding(rank)
        if loss is not None:
            found.append(loss)
    if grad_bad:
        details: dict[str, Any] = {}
        if result:
            details["replay"] = result
            grad_bad = grad_bad + [n for n in (result.get("op"), result.get("module")) if n and n not in grad_bad]
        found.append(Finding("nonfinite_grad", grad_bad, details, seen.rank(flags.NORMS)))
    if buffer_bad:
        found.append(inspector.buffer_finding(buffer_bad, seen.rank(flags.NORMS)))

    findings = merge(_distributed.gather(trainer, found))  # so that rank 0 can write every rank's findings
    mark_consequences(findings)
    return Diagnosis(findings, state_bad, amp_overflow)


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
