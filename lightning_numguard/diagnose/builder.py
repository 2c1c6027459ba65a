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
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from lightning_numguard import _compat
from lightning_numguard.decide.policy import is_amp_overflow
from lightning_numguard.detect import checks, flags
from lightning_numguard.detect import extra as _extra
from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.diagnose.findings import AFTER_FORWARD, Finding, mark_consequences, merge
from lightning_numguard.diagnose.replay import Replay
from lightning_numguard.diagnose.reproduce import Verdict, judge_reproduction, suspect_rank
from lightning_numguard.diagnose.rerun import replay_batch
from lightning_numguard.engine import group
from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.read import Reading, StepRead
from lightning_numguard.engine.record import StepRecord, StepRecorder
from lightning_numguard.state.quarantine import sample_indices

__all__ = ["Diagnosis", "StateLook", "StepView", "diagnose", "name_culprit"]


@dataclass(frozen=True)
class StateLook:
    """What an exact look at the training state found after a hit (collective: every rank looks)."""

    #: the parameters, start-of-step buffers and optimizer state that are non-finite on any rank
    state_bad: list[str] = field(default_factory=list)
    #: their findings, in causal order
    findings: list[Finding] = field(default_factory=list)
    #: the gradients and the buffers the forward pass changed that are non-finite (read at the step only)
    grad_bad: list[str] = field(default_factory=list)
    buffer_bad: list[str] = field(default_factory=list)
    #: fp16 AMP: the gradients overflowed and nothing else went bad (the GradScaler's own business)
    amp_overflow: bool = False


@dataclass
class StepView:
    """What the builder looks at: a step's record and its read, at the step (``sync_mode="every_step"``).

    The deferred read schedule hands the builder its own view of a step read one step late
    (:class:`~lightning_numguard.engine.deferred.LateView`): the records it kept for the step instead of the live
    instruments, no replay, and a slot no rank can name any more reported by its flag. The builder asks the view;
    it never asks which schedule it is in.
    """

    rec: StepRecord
    reading: Reading
    #: read one step late (the judge's facts say so; the builder's own steps ask the view's methods)
    late: ClassVar[bool] = False

    def look(self, loop: Loop, reader: StepRead, exact: bool) -> StateLook:
        """The state exactly, the step's gradients and buffers included (collective)."""
        state_bad, rank = reader.state_bad_where(loop, self.reading)
        grad_bad = group.any_rank(loop, reader.confirmed(loop, self.reading, "grads"))
        buffer_bad = group.any_rank(loop, reader.confirmed(loop, self.reading, "live_buffers"))
        amp_overflow = is_amp_overflow(
            grads_bad=bool(grad_bad),
            has_scaler=loop.scaler is not None,
            local_incident=self.reading.flags.any_local(),
            state_bad=bool(state_bad),
        )
        if amp_overflow:  # fp16 AMP: non-finite gradients are the GradScaler's business (it skips and backs off)
            grad_bad = []
        before = {"when": "before the optimizer step"}
        findings = [Finding("nonfinite_param", n, dict(before), rank, site=s) for s, n in _by_site(reader, state_bad)]
        return StateLook(state_bad, findings, grad_bad, buffer_bad, amp_overflow)

    def bad_blocks(self, watch: Any) -> list[tuple[str, float]]:
        """The watched blocks whose output went non-finite, in execution order, with their max-|x|."""
        return watch.first_bad(None) if watch is not None else []

    def op_records(self, recorder: StepRecorder) -> list[Any]:
        """The op guard's records of the step."""
        return recorder.opguard.records if recorder.opguard is not None else []

    @property
    def replays(self) -> bool:
        """Whether the step can be replayed now (its batch and the state it started from are at hand)."""
        return self.rec.batch is not None

    def op_finding(self, finding: Finding, module: str | None, upstream: str | None) -> Finding:
        """An op-domain finding as this view names it: the op, in the module that ran it, after the module that
        showed the trouble first."""
        details = {**finding.details, "upstream": upstream} if upstream else finding.details
        return replace(finding, where=[finding.where[0]], op=finding.where[0], module=module, details=details)

    def complete(self, findings: list[Finding]) -> list[Finding]:
        """The merged findings of every rank, completed by what only the view knows (read at the step: nothing)."""
        return findings

    def marked(self, finding: Finding, read_at: int) -> Finding:
        """A finding of this step as its event says it (read at the step: as it is)."""
        return finding

    def state_bad(self, loop: Loop, reader: StepRead) -> bool:
        """A batch skipped whatever it holds: whether the state is bad too (collective)."""
        return bool(reader.state_bad(loop, self.reading))

    def point_to_bad_micro_batch(self, loop: Loop, recorder: StepRecorder) -> None:
        """Under gradient accumulation, the record names the micro-batch that went bad (collective)."""
        recorder.point_to_bad_micro_batch(loop)


@dataclass
class Diagnosis:
    """What a hit turned out to be."""

    findings: list[Finding] = field(default_factory=list)
    state_bad: list[str] = field(default_factory=list)
    amp_overflow: bool = False


def diagnose(
    loop: Loop,
    recorder: StepRecorder,
    reader: StepRead,
    view: StepView,
    replay: bool,
    exact_state: bool = True,
) -> Diagnosis:
    """The findings of a hit, merged across ranks, in causal order, consequences marked.

    Each site's findings are appended in causal order (inputs, state before the step, module outputs, op domains,
    loss, checks of one's own, gradients, buffers after the forward pass). ``replay``: re-run the batch with full
    instrumentation when the forward or backward pass went bad, to name the first module (when outputs are not
    watched every step) and the culprit op (:func:`name_culprit`). ``exact_state``: look at the whole state exactly
    (``False`` under ``action="warn"`` read late, which acts on nothing). Collective.
    """
    rec, seen = view.rec, view.reading.flags
    rank, world = loop.rank, loop.world_size
    look = view.look(loop, reader, exact_state)
    found: list[Finding] = []
    if seen.seen_on(flags.INPUT, rank, world) or seen.seen_on(flags.SUSPICIOUS, rank, world):
        found += input_findings(rec, reader.max_abs_input, rank)
    found += look.findings
    output = output_finding(view.bad_blocks(recorder.watch), rank) if seen.seen(flags.OUTPUT) else None
    wanted = seen.seen(flags.OUTPUT) or seen.seen(flags.OP) or seen.seen(flags.LOSS) or bool(look.grad_bad)
    replays = replay and view.replays and wanted
    rep = _replay(loop, recorder, rec.batch, rec.batch_idx, rec.start_rng, rec.start_buffers) if replays else Replay()
    verdict = _reproduction(loop, recorder, rec, rep, look, seen) if replays else None
    culprit, modules = name_culprit(output, rep, type(loop.module).__name__, rank, attach=not view.late)
    found += modules
    first_module = modules[0].where[0] if modules else None
    if seen.seen(flags.OP):
        found += op_findings(view, view.op_records(recorder), first_module, rep.op_sites, rank)
    if seen.seen_on(flags.LOSS, rank, world) and rec.losses:
        found += loss_findings(rec, rep, culprit_named=culprit is not None, rank=rank)
    if recorder.extra_checks:  # the checks passed as extra_checks, each by its own findings
        found += _extra.findings(recorder.extra_checks, seen, rec.check_step, rec.checks, rank, world, view.late)
    if look.grad_bad:
        found.append(
            _with_replay(Finding("nonfinite_grad", look.grad_bad, {}, seen.rank(flags.NORMS)), rep, "backward")
        )
    if look.buffer_bad:
        after = {"when": AFTER_FORWARD}
        found.append(Finding("nonfinite_param", look.buffer_bad, after, seen.rank(flags.NORMS), site="buffer"))
    if verdict is not None:  # did the value come back when the step was re-run: the code and data, or the device
        found = verdict.mark(found, rank)
    if not view.late:
        checked = sorted(set(reader.check) | ({"replay"} if rep.ran else set()))
        found = [replace(f, details={**f.details, "checked": checked}) for f in found]
    findings = view.complete(merge(group.gather(loop, found)))  # so that rank 0 can write every rank's findings
    return Diagnosis(mark_consequences(findings), look.state_bad, look.amp_overflow)


def name_culprit(
    output: Finding | None, rep: Replay, root: str, rank: int, attach: bool = True
) -> tuple[Finding | None, list[Finding]]:
    """The culprit, and the findings of the step's module outputs with it first: the one place the replay's culprit
    is named.

    The rule (the replay applies it, :func:`~lightning_numguard.diagnose.provenance.culprit_of`): the culprit is
    the op that made the non-finite value reaching the detected bad value (the first module output that went bad,
    or the loss), walking past a NaN made of an accidental Inf to the op that made the Inf, and stopping at a
    deliberate one (a literal ``-inf`` mask). Here it is named: a ``nonfinite_output`` in the module that ran the op
    (``root``, the root module's class name, for its own ``forward``/``training_step``) with the op and the user's
    line. The watched block that showed the value first (``output``) is the same event when the culprit ran inside
    it (its details merged), else a consequence that received the value from the culprit. Without a forward
    culprit the replay, watching every module, still narrows the block down to the exact module. ``attach``: each
    finding carries the replay's record (read at the step).
    """
    if output is None and rep.forward_module and rep.stage != "forward":
        output = Finding("nonfinite_output", [rep.forward_module], {}, rank)
    culprit = _culprit(rep, output, root, rank) if rep.stage == "forward" else None
    shown: list[Finding] = []
    if culprit is not None:  # the op that made the value, where it ran; the module that showed it received it
        if output is not None and _inside(culprit.where[0], output.where[0]):  # the block that made it: one event
            merged = {**culprit.details, **{k: v for k, v in output.details.items() if k not in culprit.details}}
            shown = [replace(culprit, details=merged)]
        else:
            shown = [culprit]
            if output is not None:
                shown.append(replace(output, details={**output.details, "received_from": culprit.where[0]}))
    elif output is not None and rep.forward_module and rep.forward_module != output.where[0]:
        # the per-step watch names a block; the replay, watching every module, names the exact one
        block = {**output.details, "block": output.where[0]}
        shown = [replace(output, where=[rep.forward_module, *output.where[1:]], details=block)]
    elif output is not None:
        shown = [output]
    if attach:
        shown = [replace(f, details={**f.details, "replay": rep.details()}) for f in shown]
    return (shown[0] if culprit is not None else None), shown


# ------------------------------------------------------------------ the findings of each site (sync; after a hit)


def input_findings(rec: StepRecord, max_abs_input: float | None, rank: int) -> list[Finding]:
    """Non-finite and suspiciously large batch values, per micro-batch."""
    out: list[Finding] = []
    batches = [m.batch for m in rec.micro] if len(rec.micro) == len(rec.inputs) else [rec.batch] * len(rec.inputs)
    for (leaves, _), batch in zip(rec.inputs, batches):
        paths = [p for p, _ in leaves]
        values = checks.max_abs([t for _, t in leaves]).tolist()  # exact, per tensor: after a hit only
        nonfinite = [p for p, v in zip(paths, values) if not math.isfinite(v)]
        if nonfinite:
            first = dict(leaves)[nonfinite[0]]
            stats = checks.tensor_stats(first)
            out.append(Finding("nonfinite_input", nonfinite, {"stats": stats, **_where_in(first, batch)}, rank))
        if max_abs_input is not None:
            unmasked = checks.max_abs([t for _, t in leaves], masks_as_zero=True).tolist()  # finfo.min: a mask
            huge = [(p, v) for p, v in zip(paths, unmasked) if math.isfinite(v) and v >= max_abs_input]
            if huge:
                where = _where_in(dict(leaves)[huge[0][0]], batch, max_abs_input)
                details = {"max_abs": huge[0][1], "threshold": max_abs_input, **where}
                out.append(Finding("suspicious_input", [p for p, _ in huge], details, rank))
    return out


def _where_in(tensor: torch.Tensor, batch: Any, at_least: float | None = None) -> dict[str, Any]:
    """The first bad positions and samples of a batch tensor, and the dataset indices of those samples when the
    batch carries them (``batch["index"]`` and the like)."""
    found = checks.bad_positions(tensor, at_least)
    indices = sample_indices(batch) if found else None
    if indices and len(indices) == found["samples_in_batch"]:
        found["sample_indices"] = [indices[i] for i in found["samples"]]
    return found


def output_finding(bad_blocks: list[tuple[str, float]], rank: int) -> Finding | None:
    """The first watched block whose output went non-finite (with its max-|x|, and the next few bad ones)."""
    if not bad_blocks:
        return None
    first, max_abs = bad_blocks[0]
    return Finding("nonfinite_output", [first], {"max_abs": max_abs, "also": [m for m, _ in bad_blocks[1:6]]}, rank)


def op_findings(
    view: StepView, records: list[Any], first_module: str | None, sites: dict[str, list[dict[str, Any]]], rank: int
) -> list[Finding]:
    """Op calls whose inputs were outside their domain, each named by the view, at the user's line of its call."""
    if not records:
        return []
    device = records[0].flag.device  # one stack on the flags' device, one read (not a read per record)
    values = torch.stack([r.flag.detach().to(device, torch.float32).reshape(()) for r in records]).tolist()
    out: list[Finding] = []
    calls: dict[str, int] = {}
    for record, flag in zip(records, values):
        call = calls.get(record.op, 0)
        calls[record.op] = call + 1
        if not flag:
            continue
        details = OpGuard.describe(record)
        finding = Finding("op_domain", [record.op] + ([record.module] if record.module else []), details, rank)
        finding = view.op_finding(finding, record.module, first_module)
        lines = sites.get(record.op) or []
        line = lines[min(call, len(lines) - 1)] if lines else {}
        out.append(replace(finding, source=f"{line['file']}:{line['line']}") if line.get("file") else finding)
    return out


def loss_findings(rec: StepRecord, rep: Replay, culprit_named: bool, rank: int) -> list[Finding]:
    """The non-finite loss values of the step's micro-batches; when no module output went bad, the loss code made
    the value and the replay's culprit is named here."""
    values = [float(x.float().mean()) for x in rec.losses]
    if all(math.isfinite(v) for v in values):
        return []
    loss = Finding("nonfinite_loss", ["loss"], {"values": values}, rank)
    return [_with_replay(loss, rep, "forward" if not culprit_named else None)]


def _with_replay(finding: Finding, rep: Replay, names: str | None) -> Finding:
    """``finding`` with the replay's record when it ran, and its culprit op when the replay's stage is ``names``."""
    if not rep.ran:
        return finding
    finding = replace(finding, details={**finding.details, "replay": rep.details()})
    return _named(finding, rep) if names is not None and rep.stage == names else finding


def _culprit(rep: Replay, output: Finding | None, root: str, rank: int) -> Finding | None:
    """A forward culprit that reached a module's output, as a finding in the module that ran the op (``None`` when
    no module output went non-finite: the loss code made the value, and the loss finding names it)."""
    if output is None and not rep.forward_module and not rep.op_module:
        return None
    module = rep.op_module or root
    details: dict[str, Any] = {"own_code": True} if not rep.op_module else {}
    if output is not None and module != output.where[0] and _inside(module, output.where[0]):
        details["block"] = output.where[0]
    return replace(_named(Finding("nonfinite_output", [module], details, rank), rep), module=module)


def _inside(module: str, block: str) -> bool:
    """Whether ``module`` is ``block`` or one of its submodules (by qualified name)."""
    return module == block or module.startswith(block + ".")


def _named(finding: Finding, rep: Replay) -> Finding:
    """``finding`` with the replay's culprit op, its module and the user's line in its own fields."""
    return replace(finding, op=rep.op, module=rep.op_module or rep.module, source=rep.source or finding.source)


def _by_site(reader: StepRead, names: list[str]) -> list[tuple[str, list[str]]]:
    """``names`` split into parameters, buffers and optimizer state (one kind of name per event)."""
    params = {n for n, _ in reader.named_params}
    groups: dict[str, list[str]] = {}
    for name in names:
        site = "optimizer_state" if name.startswith("optimizer[") else "param" if name in params else "buffer"
        groups.setdefault(site, []).append(name)
    return [(site, groups[site]) for site in ("param", "buffer", "optimizer_state") if site in groups]


def _replay(
    loop: Loop,
    recorder: StepRecorder,
    batch: Any,
    batch_idx: int,
    rng: dict[str, Any] | None,
    start_buffers: dict[str, torch.Tensor] | None = None,
) -> Replay:
    """The step's replay, with the per-step watch off (the replay watches every module itself), from the buffers the
    step started from (``start_buffers``: a value written into a buffer during the step, in ``training_step`` before
    the forward pass, is then made again by the write, which the replay names at its line); the live buffers are put
    back afterwards. A replay from the start buffers that stays finite is run once more from the live ones: a buffer
    written between the step's start and its forward pass by code the replay does not re-run (the module's own
    ``on_train_batch_start``) made the value, which is then no fault of the device (one process: a replay is
    collective under sharding, and the ranks' verdicts differ)."""
    watch = recorder.watch
    watching = watch.enabled if watch is not None else False
    if watch is not None:
        watch.enabled = False
    live = None
    if start_buffers:
        names = dict(loop.module.named_buffers())
        live = {n: names[n].detach().clone() for n in start_buffers if n in names}
        loop.module.load_state_dict(start_buffers, strict=False)
    try:
        rep = replay_batch(loop, batch, batch_idx, rng)
        if live and rep.reproduced is False and loop.world_size == 1 and _differ(live, start_buffers):
            loop.module.load_state_dict(live, strict=False)
            again = replay_batch(loop, batch, batch_idx, rng)
            rep = again if again.reproduced is not False else rep
        for source in rep.drew:  # the fit draws from it: every step keeps its state from now on
            recorder.rng.keep(source)
        return rep
    finally:
        if live:
            loop.module.load_state_dict(live, strict=False)
        if watch is not None:
            watch.enabled = watching


def _differ(live: dict[str, torch.Tensor], start: dict[str, torch.Tensor] | None) -> bool:
    """Whether a buffer is not what it was at the step's start (after a hit only: one read per buffer)."""
    start = start or {}
    return any(n in start and not torch.equal(t, start[n].to(t.device)) for n, t in live.items())


def _reproduction(
    loop: Loop, recorder: StepRecorder, rec: StepRecord, rep: Replay, look: StateLook, seen: flags.StepFlags
) -> Verdict | None:
    """Whether the step's non-finite value came back when the step was re-run (collective; see
    :mod:`~lightning_numguard.diagnose.reproduce`): ``None`` when its reproducibility says nothing."""
    suspect = suspect_rank(seen, bool(look.state_bad), bool(look.grad_bad), loop.world_size)
    if suspect is None:
        return None

    def rerun(batch: Any, batch_idx: int, rng: dict[str, Any] | None) -> Replay:  # the neighbour's, of a sent batch
        return _replay(loop, recorder, batch, batch_idx, rng, rec.start_buffers)

    compiled = _compat.compiled(loop.module)
    return judge_reproduction(loop, suspect, rep, rec.batch, rec.batch_idx, rec.start_rng, rerun, compiled)
