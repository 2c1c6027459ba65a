"""The step record and its one read: what a training step recorded on the device, and what it found.

:class:`StepInspector` owns the per-step instruments (the output watch, the op guard) and the
names of what it checks. A step goes through it as:

1. :meth:`~StepInspector.begin` (batch start): the batch's max-|x| and the state at the start;
2. :meth:`~StepInspector.record_loss` (before backward);
3. :meth:`~StepInspector.read` (before the optimizer step): pack every flag, reduce across ranks,
   read once on the host;
4. :meth:`~StepInspector.findings` (only after a hit): exact per-tensor detail, as
   :class:`~lightning_numguard.core.findings.Finding` objects in causal order.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from typing import Any, cast

import pytorch_lightning as pl
import torch

from lightning_numguard import _compat
from lightning_numguard.callbacks import _distributed, _micro
from lightning_numguard.core import checks, flags, spike
from lightning_numguard.core.dtensor import local
from lightning_numguard.core.findings import AFTER_FORWARD, Finding
from lightning_numguard.core.opguard import OpGuard
from lightning_numguard.core.snapshot import rng_state
from lightning_numguard.core.stateful import clone_states
from lightning_numguard.core.tree import floating_leaves
from lightning_numguard.core.watch import OutputWatch

__all__ = ["Reading", "StepInspector", "StepRecord"]

log = logging.getLogger(__name__)

Named = list[tuple[str, torch.Tensor]]


@dataclass
class StepRecord:
    """What one optimizer step (one accumulation window) has recorded so far, on the device."""

    epoch: int
    batch_idx: int
    batch: Any = None
    # per micro-batch: the floating leaves of the batch and their max-|x| (0-d, NaN propagates)
    inputs: list[tuple[Named, torch.Tensor]] = field(default_factory=list)
    # per micro-batch: the max-|x| the suspicious-input check reads (dtype extremes, i.e. masks, left out)
    input_unmasked: list[torch.Tensor] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    start_buffers: dict[str, torch.Tensor] | None = None
    start_states: dict[str, Any] | None = None
    start_rng: dict[str, Any] | None = None
    forced_skip: str | None = None
    quarantine_flag: torch.Tensor | None = None
    read_done: bool = False
    bad: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    action: str = "none"
    step: int = 0
    # every micro-batch of the window (one entry without accumulation); after a hit ``batch`` and
    # ``batch_idx`` above are those of the first bad micro-batch (``bad_micro_batch`` is its index here)
    micro: list[_micro.MicroBatch] = field(default_factory=list)
    bad_micro_batch: int = 0
    seen_at_read: tuple[int, int] = (0, 0)  # losses and output records already read by an earlier optimizer
    spike_read: bool = False  # the spike statistics' values went into a read of this step


@dataclass
class Reading:
    """The decoded flags of one read and the named tensors that went into its ``NORMS`` slot."""

    flags: flags.StepFlags
    segments: dict[str, Named]
    #: the host-read spike extras after the flag slots (``core.spike.EXTRAS``), when the step carried them
    extras: list[float] = field(default_factory=list)


class StepInspector:
    """Records each step on the device and reads it once; names the culprits after a hit.

    Args:
        check: the sites checked every step (``NumGuardCallback(check=...)``).
        max_abs_input: the suspicious-input threshold, or ``None``.
        watch_modules: glob patterns of the modules whose outputs are watched.
        ignore_modules: glob patterns of modules not watched.
        watch_depth: the depth of the blocks whose outputs are watched (``None``: every module).
    """

    def __init__(
        self,
        check: list[str],
        max_abs_input: float | None,
        watch_modules: list[str],
        ignore_modules: list[str],
        watch_depth: int | None = 1,
    ) -> None:
        self.check = check
        self.max_abs_input = max_abs_input
        self.watch_modules = watch_modules
        self.ignore_modules = ignore_modules
        self.watch_depth = watch_depth  # blocks, not every module (core.watch.select_modules)
        self.record: StepRecord | None = None
        self.watch: OutputWatch | None = None
        self.opguard: OpGuard | None = None
        self._opguard_entered = False
        self._module_names: dict[int, str] = {}
        self.named_params: Named = []
        self.param_names: dict[int, str] = {}
        self._named_buffers: Named = []
        self._start_buffers: list[torch.Tensor] = []
        self._live_buffers: list[torch.Tensor] = []
        self._start_checked: Named = []  # checked buffers paired with their start-of-step copies
        self._start_buffer_map: dict[str, torch.Tensor] = {}
        self.unchecked_buffers: set[str] = set()
        self.checked_buffers: Named = []
        self._metric_keys: list[str] = []
        # Per optimizer: its param groups' layout (key), the names and parameters checked, and their plan.
        self._opt_params: dict[
            int, tuple[Any, list[tuple[list[Any], int]], list[str], list[torch.Tensor], checks.TotalPlan]
        ] = {}
        self._grads_plan: checks.TotalPlan | None = None  # the plan of the gradients grads() last returned
        self._grads: list[torch.Tensor] = []  # those gradients, when the plan applies
        # per state segment: its named list, its tensors and their plan, kept while the list is the same object
        self._segment_plans: dict[str, tuple[Named, list[torch.Tensor], checks.TotalPlan]] = {}
        self._opt_state: tuple[list[torch.Tensor], Named] | None = None  # the optimizer state tensors, named
        # Whether parameters, buffers and optimizer state may go through the CPU's fused check, which writes the
        # same bits back: not while a snapshot copies them on another thread (set at train start)
        self.state_rewritable = False
        # Spike statistics and overflow headroom (callbacks/_spike.SpikeGuard), set by the callback: their
        # values ride after the flag slots in the one read; the global gradient norm is the grads' check
        self.spike: Any = None
        self.extras: torch.Tensor | None = None  # this read's extras (before the reduce), taken by read/pack
        self._grad_norm: torch.Tensor | None = None
        # batch fields no longer checked: flagged on step after step, a convention of the data (callbacks/_conventions)
        self.ignored_inputs: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    def attach(self, pl_module: pl.LightningModule) -> None:
        """Create the op guard and register the output hooks (before any ``torch.compile`` runs)."""
        if "ops" in self.check:
            self.opguard = OpGuard(check_cpu_calls=False)  # CPU kernels check their own inputs: see OpGuard
            self.opguard.enabled = False
            self.opguard.module_resolver = self._calling_module
            self.opguard.hold()  # the functions stay wrapped for the fit: a step only pushes the guard
        if "outputs" in self.check:
            self.watch = OutputWatch(pl_module, self.watch_modules, self.ignore_modules, self.watch_depth)
            self.watch.attach()
        self._module_names = {id(m): n for n, m in pl_module.named_modules()}

    def detach(self) -> None:
        """Leave the op guard's mode and remove every hook (idempotent)."""
        self.exit_ops()
        if self.opguard is not None:
            self.opguard.release()
        if self.watch is not None:
            self.watch.detach()

    def resolve(self, pl_module: pl.LightningModule, stateful: dict[str, Any]) -> None:
        """Resolve names once per fit: the hot path must not walk the module tree every step."""
        self.named_params = list(pl_module.named_parameters())
        self.param_names = {id(p): n for n, p in self.named_params}
        self._opt_params = {}
        self._segment_plans = {}
        self._opt_state = None
        persistent = set(pl_module.state_dict())
        self._named_buffers = [(n, b) for n, b in pl_module.named_buffers() if n in persistent]
        self._start_buffers = [b.detach().clone() for _, b in self._named_buffers]
        self._start_buffer_map = {n: c for (n, _), c in zip(self._named_buffers, self._start_buffers)}
        self._live_buffers = [b for _, b in self._named_buffers]
        self._metric_keys = [k for k in stateful if k.startswith("metric:")]

    def leave_unchecked(self, bad_at_start: list[str]) -> list[str]:
        """Buffers non-finite at fit start by design (a float causal mask of ``0``/``-inf``) are never checked.

        Returns the names in ``bad_at_start`` that are *not* such buffers: state gone bad.
        """
        buffer_names = {n for n, _ in self._named_buffers}
        self.unchecked_buffers = {n for n in bad_at_start if n in buffer_names}
        if self.unchecked_buffers:
            log.info("numguard leaves buffers non-finite at fit start unchecked: %s", sorted(self.unchecked_buffers))
        self.checked_buffers = [
            (n, b) for n, b in self._named_buffers if n not in self.unchecked_buffers and b.is_floating_point()
        ]
        self._start_checked = [(n, self._start_buffer_map[n]) for n, _ in self.checked_buffers]
        return [n for n in bad_at_start if n not in self.unchecked_buffers]

    # ------------------------------------------------------------------ recording

    def begin(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        keep_start: bool,
        stateful: dict[str, Any],
    ) -> StepRecord:
        """Start (or continue, within an accumulation window) the step record of ``batch``."""
        rec = self.record
        if rec is None:
            rec = self.record = StepRecord(epoch=trainer.current_epoch, batch_idx=batch_idx, batch=batch)
            if self.watch is not None:  # forget outputs recorded between steps (a retry after a rollback)
                self.watch.reset()
            if keep_start:
                if self._start_buffers:  # one fused copy of every buffer, into storage reused each step
                    _compat.foreach_copy_(self._start_buffers, self._live_buffers)
                rec.start_buffers = self._start_buffer_map
                # numpy's RNG is left to the snapshot: reading its state costs ~0.1 ms, more than all the rest
                rec.start_states = clone_states(stateful, self._metric_keys)
                rec.start_rng = rng_state()
        micro = _micro.MicroBatch(
            batch_idx, batch, first_output=len(self.watch.records) if self.watch is not None else 0
        )
        if rec.start_rng is not None:
            micro.rng = _micro.micro_rng(rec.start_rng) if rec.micro else rec.start_rng
        rec.micro.append(micro)
        if "inputs" in self.check:
            leaves = floating_leaves(batch)
            if self.ignored_inputs:
                leaves = [(p, t) for p, t in leaves if p not in self.ignored_inputs]
            if leaves:
                total, unmasked = checks.input_maxima([t for _, t in leaves], pl_module.device)
                rec.inputs.append((leaves, total))
                rec.input_unmasked.append(unmasked)
                micro.input_max = total
        return rec

    def enter_ops(self) -> None:
        """Switch the op guard on for the forward pass."""
        if self.opguard is not None:
            self.opguard.enabled = True
            if not self._opguard_entered:
                self.opguard.__enter__()
                self._opguard_entered = True

    def exit_ops(self) -> None:
        """Switch the op guard off (the backward pass and everything outside a step are not guarded)."""
        guard = self.opguard
        if guard is None:
            return
        guard.enabled = False
        if self._opguard_entered:
            self._opguard_entered = False
            try:
                guard.__exit__(None, None, None)
            except Exception:  # the mode stack was changed under us; nothing left to undo
                log.debug("numguard op guard was not on top of the mode stack", exc_info=True)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Keep the loss of this micro-batch for the step's read."""
        if "loss" in self.check and self.record is not None:
            self.record.losses.append(local(loss.detach()))  # a DTensor loss (loss parallel): this rank's part
            if self.record.micro:
                self.record.micro[-1].loss = self.record.losses[-1]

    def end(self) -> StepRecord | None:
        """Close the step record and clear the instruments for the next step."""
        rec, self.record = self.record, None
        if self.watch is not None:
            self.watch.reset()
        if self.opguard is not None:
            self.opguard.reset()
        return rec

    def forget_forward(self) -> None:
        """Drop what the forward pass recorded (a further optimizer of the same batch reads its gradients only)."""
        assert self.record is not None
        n_losses, n_outputs = self.record.seen_at_read  # keep what came after the last read (manual optimization)
        self.record.inputs, self.record.input_unmasked = [], []
        self.record.losses = self.record.losses[n_losses:]
        if self.watch is not None:
            self.watch.records[:n_outputs] = []
        if self.opguard is not None:
            self.opguard.reset()

    # ------------------------------------------------------------------ the read

    def read(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, snapshot_due: bool) -> Reading:
        """Pack every flag of the step, all-reduce once, read once (the step's one host sync)."""
        rec = self.record
        assert rec is not None
        rec.read_done = True
        rec.seen_at_read = (len(rec.losses), len(self.watch.records) if self.watch is not None else 0)
        rec.step = trainer.global_step
        slots, segments = self.slot_values(trainer, pl_module, optimizer, snapshot_due)
        world = trainer.world_size
        extras, self.extras = self.extras, None
        n = len(flags.SLOTS)
        if world == 1:  # nothing to reduce: the host judges the raw values (one stack, the step's one read)
            vector = flags.stack_raw(list(slots.values()))
            if extras is not None:  # the spike statistics ride in the same read
                vector = torch.cat([vector, extras.to(vector.device)])
                self.spike.reduced = vector[n:]
            values = vector.tolist()
            return Reading(flags.decode_raw(values[:n]), segments, values[n:])
        values = self.reduce(trainer, slots, extras).tolist()  # the one host read of the step
        return Reading(flags.decode(values[:n], world), segments, values[n:])

    def reduce(self, trainer: pl.Trainer, slots: dict[str, torch.Tensor], extras: torch.Tensor | None) -> torch.Tensor:
        """The rank-encoded flag vector with the spike statistics' raw values (``extras``) after it, all-reduced
        (``MAX``) across ranks in one call, on the device; the statistics' reduced values go to ``spike.reduced``."""
        packed = flags.encode_rank(flags.pack(**slots), trainer.global_rank, trainer.world_size)
        if extras is not None:  # raw values (not rank-encoded) in the same all-reduce
            packed = torch.cat([packed, extras.to(packed.device)])
        reduced = _distributed.reduce_max(trainer, packed)
        if extras is not None:
            self.spike.reduced = reduced[len(flags.SLOTS) :]
        return reduced

    def slot_values(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, snapshot_due: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, Named]]:
        """The step's 0-d slot values on the device, in :data:`~lightning_numguard.core.flags.SLOTS` order, named as
        :func:`~lightning_numguard.core.flags.pack`'s arguments, and the named tensors of its ``NORMS`` slot; no sync.

        Shared by :meth:`read` and the deferred mode (``callbacks/_zerosync.py``), which packs them without reading.
        """
        rec = self.record
        assert rec is not None
        device = pl_module.device
        # Everything state- and gradient-checked goes into one slot (see _norm_total).
        segments: dict[str, Named] = {}
        every_buffer = "buffers" in self.check or "params" in self.check
        wanted = {
            "params": "params" in self.check or snapshot_due,
            "start_buffers": every_buffer or snapshot_due,  # buffers as they were before the forward pass
            "opt_state": "optimizer_state" in self.check or snapshot_due,
        }
        for name, on in wanted.items():
            if on and (named := self.segment(name, trainer)):
                segments[name] = named
        if "grads" in self.check and optimizer is not None:
            segments["grads"] = self.grads(optimizer)
        if every_buffer:  # buffers after the forward pass (BatchNorm running stats)
            segments["live_buffers"] = self.checked_buffers
        zero = torch.zeros((), dtype=torch.float32, device=device)
        input_max = unmasked = zero
        if rec.inputs:
            input_max = rec.inputs[0][1] if len(rec.inputs) == 1 else torch.stack([v for _, v in rec.inputs]).amax()
            unmasked = rec.input_unmasked[0] if len(rec.inputs) == 1 else torch.stack(rec.input_unmasked).amax()
        watch = self.watch if self.watch is not None and self.watch.enabled else None
        losses = [x.to(device, torch.float32) for x in rec.losses]
        loss_total = zero
        if losses:
            loss_total = losses[0] if len(losses) == 1 and losses[0].dim() == 0 else torch.stack(losses).sum()
        self._grad_norm = None
        slots = {
            "input_max": input_max,
            "norm_total": self._norm_total(segments, device, zero),
            "output_total": watch.total(device) if watch is not None else zero,
            "loss_total": loss_total,
            "suspicious": (unmasked >= self.max_abs_input).float() if self.max_abs_input is not None else zero,
            "op": self.opguard.flags(device).amax() if self.opguard is not None and self.opguard.records else zero,
            "quarantine": rec.quarantine_flag.to(device) if rec.quarantine_flag is not None else zero,
        }
        self.extras = None
        if self.spike is not None and self.spike.enabled and not rec.spike_read:
            rec.spike_read = True  # the step's first read only (a further optimizer reads its gradients alone)
            loss = loss_total if losses else None
            rank, world = trainer.global_rank, trainer.world_size
            self.extras = self.spike.extras(loss, self._grad_norm, watch, device, rank, world)
        return slots, segments

    def _norm_total(self, segments: dict[str, Named], device: torch.device, zero: torch.Tensor) -> torch.Tensor:
        """The ``NORMS`` slot's total: the gradients through the check that may rewrite them (on the CPU: the fused
        check, which writes the same bits back), the state likewise when :attr:`state_rewritable`, else read-only.

        Each segment's :class:`~lightning_numguard.core.checks.TotalPlan` is kept while the segment is the same
        list object (the parameters and buffers are resolved once per fit, the optimizer state while its
        tensors stay the same): a step does no per-tensor grouping.
        """
        totals = []
        for name, named in segments.items():
            if not named:
                continue
            if name == "grads":
                if self.spike is not None and self.spike.window is not None:  # the global L2 norm is the check
                    plan = self._grads_plan if self._grads_plan is not None else checks.TotalPlan([t for _, t in named])
                    grads = self._grads if self._grads_plan is not None else [t for _, t in named]
                    if plan.local:  # DTensors (FSDP2, tensor parallel): this rank's shards; the reduce takes the max
                        grads = [local(t) for t in grads]
                    groups = [[grads[i] for i in large + small] for _, _, large, small in plan.groups]
                    self._grad_norm = spike.global_norm(groups, device)
                    totals.append(self._grad_norm)
                elif self._grads_plan is not None:  # grads() found every gradient: its plan and tensor list
                    totals.append(self._grads_plan.total(self._grads, device, rewritable=True))
                else:
                    grads = [t for _, t in named]
                    totals.append(checks.TotalPlan(grads).total(grads, device, rewritable=True))
                continue
            cached = self._segment_plans.get(name)
            if cached is None or cached[0] is not named:
                tensors = [t for _, t in named]
                cached = self._segment_plans[name] = (named, tensors, checks.TotalPlan(tensors))
            totals.append(cached[2].total(cached[1], device, rewritable=self.state_rewritable))
        if not totals:
            return zero
        return totals[0] if len(totals) == 1 else torch.stack(totals).sum()

    # ------------------------------------------------------------------ after a hit

    def point_to_bad_micro_batch(self, trainer: pl.Trainer | None = None) -> None:
        """Under gradient accumulation, make ``record.batch``/``batch_idx``/``start_rng`` the first bad micro-batch's.

        See :func:`~lightning_numguard.callbacks._micro.first_bad` (syncs, after a hit only; collective with
        ``trainer`` under DDP).
        """
        rec = self.record
        if rec is None or len(rec.micro) < 2:
            return
        first = _micro.first_bad(trainer, rec, self.watch)
        rec.bad_micro_batch = first
        rec.batch, rec.batch_idx = rec.micro[first].batch, rec.micro[first].batch_idx
        rec.start_rng = rec.micro[first].rng or rec.start_rng

    def confirmed(self, trainer: pl.Trainer, reading: Reading, segment: str) -> list[str]:
        """The names in ``segment`` that are exactly non-finite (syncs; after a hit only)."""
        if segment in reading.segments:
            named = reading.segments[segment]
            if not reading.flags.seen(flags.NORMS):  # part of the step's flag, which proved it finite
                return []
        else:  # not checked every step: after a hit, look at it exactly (the root cause may be there)
            named = self.segment(segment, trainer)
        if not named:
            return []
        return [n for (n, _), bad in zip(named, checks.confirm_nonfinite([t for _, t in named])) if bad]

    def state_bad(self, trainer: pl.Trainer, reading: Reading) -> list[str]:
        """Parameters, buffers at the step start and optimizer state that are non-finite on any rank."""
        return self.state_bad_where(trainer, reading)[0]

    def state_bad_where(self, trainer: pl.Trainer, reading: Reading) -> tuple[list[str], int]:
        """:meth:`state_bad`, and the lowest rank where that state was non-finite (``-1`` when none)."""
        names = [n for s in ("params", "start_buffers", "opt_state") for n in self.confirmed(trainer, reading, s)]
        return _distributed.first_rank(trainer, names)

    def input_findings(self, rank: int) -> list[Finding]:
        """Non-finite and suspiciously large batch values, per micro-batch (syncs)."""
        assert self.record is not None
        out: list[Finding] = []
        for leaves, _ in self.record.inputs:
            paths = [p for p, _ in leaves]
            values = checks.max_abs([t for _, t in leaves]).tolist()  # exact, per tensor: after a hit only
            nonfinite = [p for p, v in zip(paths, values) if not math.isfinite(v)]
            if nonfinite:
                stats = checks.tensor_stats(dict(leaves)[nonfinite[0]])
                out.append(Finding("nonfinite_input", nonfinite, {"stats": stats}, rank))
            if self.max_abs_input is not None:
                unmasked = checks.max_abs([t for _, t in leaves], masks_as_zero=True).tolist()  # finfo.min: a mask
                huge = [(p, v) for p, v in zip(paths, unmasked) if math.isfinite(v) and v >= self.max_abs_input]
                if huge:
                    details = {"max_abs": huge[0][1], "threshold": self.max_abs_input}
                    out.append(Finding("suspicious_input", [p for p, _ in huge], details, rank))
        return out

    def output_finding(self, rank: int) -> Finding | None:
        """The first watched module whose output went non-finite (syncs)."""
        bad_modules = self.watch.first_bad() if self.watch is not None else []
        if not bad_modules:
            return None
        first, lo, hi = bad_modules[0]
        return Finding(
            "nonfinite_output", [first], {"min": lo, "max": hi, "also": [m for m, _, _ in bad_modules[1:6]]}, rank
        )

    def op_findings(self, first_module: str | None, rank: int) -> list[Finding]:
        """Op calls whose inputs were outside their domain (syncs)."""
        guard = self.opguard
        if guard is None or not guard.records:
            return []
        out: list[Finding] = []
        for record, flag in zip(guard.records, guard.flags(guard.records[0].flag.device).tolist()):
            if flag:
                details = dict(OpGuard.describe(record))
                if first_module:
                    details["upstream"] = first_module
                out.append(
                    Finding("op_domain", [record.op] + ([record.module] if record.module else []), details, rank)
                )
        return out

    def loss_finding(self, rank: int) -> Finding | None:
        """The non-finite loss values of the step's micro-batches (syncs)."""
        assert self.record is not None
        values = [float(x.float().mean()) for x in self.record.losses]
        if any(not math.isfinite(v) for v in values):
            return Finding("nonfinite_loss", ["loss"], {"values": values}, rank)
        return None

    @staticmethod
    def buffer_finding(names: list[str], rank: int) -> Finding:
        """Buffers that the forward pass made non-finite (BatchNorm running statistics)."""
        return Finding("nonfinite_param", names, {"when": AFTER_FORWARD}, rank)

    # ------------------------------------------------------------------ named tensors

    def grads(self, optimizer: Any) -> Named:
        """The named gradients of ``optimizer``'s parameters.

        The floating, non-empty parameters and their names are resolved once per optimizer (and again when its
        param groups change), with the :class:`~lightning_numguard.core.checks.TotalPlan` of their layout; a step
        only reads each ``.grad`` (a new tensor each step, with its parameter's dtype and shape) and skips missing
        and sparse ones. When none is skipped, :meth:`read` checks them with that plan.
        """
        groups = optimizer.param_groups
        cached = self._opt_params.get(id(optimizer))
        if (
            cached is None
            or cached[0] is not optimizer
            or len(cached[1]) != len(groups)
            or any(g["params"] is not ps or len(ps) != n for g, (ps, n) in zip(groups, cached[1]))
        ):
            layout = [(g["params"], len(g["params"])) for g in groups]
            checked = [p for g in groups for p in g["params"] if p.is_floating_point() and p.numel() > 0]
            labels = [self.param_names.get(id(p), "?") for p in checked]
            cached = (optimizer, layout, labels, checked, checks.TotalPlan(checked))
            self._opt_params[id(optimizer)] = cached
        labels, checked, plan = cached[2], cached[3], cached[4]
        grads = [p.grad for p in checked]
        strided = torch.strided
        for g in grads:
            if g is None or g.layout is not strided:  # a parameter without a gradient, or a sparse one
                self._grads_plan = None
                return [(n, g) for n, g in zip(labels, grads) if g is not None and g.layout is strided]
        self._grads_plan, self._grads = plan, cast("list[torch.Tensor]", grads)  # the usual step: the plan applies
        return list(zip(labels, self._grads))

    def segment(self, segment: str, trainer: pl.Trainer) -> Named:
        """The named tensors of one state segment, for the step's flag or for an exact look after a hit."""
        if segment == "params":
            return self.named_params
        if segment == "opt_state":
            return self.optimizer_state(trainer)
        if segment == "start_buffers" and self.record is not None and self.record.start_buffers is not None:
            return self._start_checked  # the start-of-step copies live in storage reused every step
        if segment == "live_buffers":
            return self.checked_buffers
        return []

    def state(self, trainer: pl.Trainer, with_optimizer: bool) -> Named:
        """Parameters and checked buffers (and optimizer state), with names, for a whole-state check."""
        named = list(self.named_params) + [(n, b) for n, b in self._named_buffers if n not in self.unchecked_buffers]
        return named + (self.optimizer_state(trainer) if with_optimizer else [])

    def optimizer_state(self, trainer: pl.Trainer) -> Named:
        """Every optimizer's floating state tensors, named ``optimizer[i].state[<param>].<key>``.

        The named list is kept while every state tensor is the same object (optimizers update their state in
        place; a first step, ``load_state_dict`` or a restore replaces it, and the list is rebuilt): a step
        that checks the optimizer state only walks the tensors, with no names built.
        """
        live = [
            value
            for opt in trainer.optimizers
            for state in opt.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        cached = self._opt_state
        if cached is not None and len(cached[0]) == len(live) and all(a is b for a, b in zip(cached[0], live)):
            return cached[1]
        out: Named = []
        for i, opt in enumerate(trainer.optimizers):
            for param, state in opt.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and checks.is_checkable(value):
                        out.append((f"optimizer[{i}].state[{self.param_names.get(id(param), '?')}].{key}", value))
        self._opt_state = (live, out)
        return out

    def _calling_module(self) -> str | None:
        """The innermost module whose code is running (called only at guarded ops, a few per step).

        Walking the Python frames here replaces a pre-hook on every module's forward.
        """
        frame = sys._getframe(2)
        names = self._module_names
        while frame is not None:
            owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
            if owner is not None and id(owner) in names:
                return names[id(owner)] or None  # the LightningModule itself: "" -> None
            frame = frame.f_back  # type: ignore[assignment]
        return None
