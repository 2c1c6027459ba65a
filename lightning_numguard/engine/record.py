"""The step record: what a training step saw, on the device, and the instruments that record it.

:class:`StepRecorder` owns the per-step instruments (the output watch and the op guard) and the
:class:`StepRecord` of the step in progress:

1. :meth:`~StepRecorder.begin` (batch start): the batch's max-|x|, the buffers, metric states and RNG at
   the step's start;
2. :meth:`~StepRecorder.enter_ops` / :meth:`~StepRecorder.exit_ops`: the op guard on for the forward pass;
3. :meth:`~StepRecorder.record_loss` (before backward);
4. :meth:`~StepRecorder.end` (batch end): the instruments cleared for the next step.

The recorder is the one writer of a :class:`StepRecord`: the other parts read it and hand what they found to its
named methods (:meth:`~StepRecorder.force_skip`, :meth:`~StepRecorder.flag_quarantine`,
:meth:`~StepRecorder.mark_read`, :meth:`~StepRecorder.mark_spike_read`, :meth:`~StepRecorder.settle`);
``tests/test_record_owner.py`` fails on an assignment to a record's field anywhere else.
Nothing here reads a value on the host; the read is :mod:`~lightning_numguard.engine.read`'s.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from lightning_numguard import _compat
from lightning_numguard.detect import checks
from lightning_numguard.detect import extra as _extra
from lightning_numguard.detect.checks import InputEnds
from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.detect.registry import Check, CheckStep
from lightning_numguard.detect.watch import OutputWatch
from lightning_numguard.dtensor import local
from lightning_numguard.engine import micro as _micro
from lightning_numguard.engine.loop import Loop
from lightning_numguard.state.rng import StepRng
from lightning_numguard.state.stateful import clone_states
from lightning_numguard.tree import floating_leaves

if TYPE_CHECKING:
    from lightning_numguard.decide.judge import Decision

__all__ = ["Named", "StepRecord", "StepRecorder"]

log = logging.getLogger(__name__)

Named = list[tuple[str, torch.Tensor]]
_TENSOR = operator.itemgetter(1)  # of a named tensor


@dataclass
class StepRecord:
    """What one optimizer step (one accumulation window) has recorded so far, on the device."""

    epoch: int
    batch_idx: int
    batch: Any = None
    # per micro-batch: the floating leaves of the batch and their 0-d ends (min and max per tensor, by dtype), which
    # the read reduces to the max-|x| both input checks read (dtype extremes, i.e. masks, left out)
    inputs: list[tuple[Named, InputEnds]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    start_buffers: dict[str, torch.Tensor] | None = None
    start_states: dict[str, Any] | None = None
    start_rng: dict[str, Any] | None = None
    forced_skip: str | None = None
    quarantine_flag: torch.Tensor | None = None
    read_done: bool = False
    step: int = 0
    # the judgement of this step's read and its events (set by the pipeline; carried out at batch end)
    decision: Decision | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    # every micro-batch of the window (one entry without accumulation); after a hit ``batch`` and
    # ``batch_idx`` above are those of the first bad micro-batch (``bad_micro_batch`` is its index here)
    micro: list[_micro.MicroBatch] = field(default_factory=list)
    bad_micro_batch: int = 0
    seen_at_read: tuple[int, int] = (0, 0)  # losses and output records already read by an earlier optimizer
    spike_read: bool = False  # the spike statistics' values went into a read of this step
    # the checks passed as extra_checks: their values this step (by kind) and what they see of it
    checks: dict[str, torch.Tensor] = field(default_factory=dict)
    check_step: CheckStep | None = None

    @property
    def action(self) -> str:
        """The action taken on this step (``"none"`` when its read found nothing to act on)."""
        return self.decision.action if self.decision is not None else "none"

    @property
    def bad(self) -> bool:
        """Whether this step's optimizer step is a no-op (skipped, rolled back or halted): the one spelling of
        "this step is skipped" once it is judged."""
        return self.decision is not None and self.decision.skips

    @property
    def skip_forced(self) -> bool:
        """Whether the step is skipped whatever its read finds (``forced_skip`` says why): the one spelling of
        "this step is known to be skipped" before it is judged."""
        return self.forced_skip is not None


class StepRecorder:
    """The instruments of a fit and the record of the step in progress.

    Args:
        check: the sites checked every step (``NumGuardCallback(check=...)``).
        watch_modules: glob patterns of the modules whose outputs are watched.
        ignore_modules: glob patterns of modules not watched.
        watch_depth: the depth of the blocks whose outputs are watched (``None``: every module).
    """

    def __init__(
        self,
        check: list[str],
        watch_modules: list[str],
        ignore_modules: list[str],
        watch_depth: int | None = 1,
        ignored_inputs: set[str] | None = None,
        extra_checks: tuple[Check, ...] = (),
    ) -> None:
        self.check = check
        self._inputs, self._loss = "inputs" in check, "loss" in check  # checked every step: asked at every step
        self.extra_checks = extra_checks
        self.watch_modules = watch_modules
        self.ignore_modules = ignore_modules
        self.watch_depth = watch_depth  # blocks, not every module (core.watch.select_modules)
        self.record: StepRecord | None = None
        self.watch: OutputWatch | None = None
        self.opguard: OpGuard | None = None
        self._opguard_entered = False
        self._module_names: dict[int, str] = {}
        # batch fields no longer checked: flagged on step after step, a convention of the data
        # (callbacks/state/_conventions)
        self.ignored_inputs: set[str] = ignored_inputs if ignored_inputs is not None else set()
        # the buffers copied at each step's start (set once per fit by the read's name resolution)
        self.start_copies: tuple[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]] = ([], [], {})
        self.metric_keys: list[str] = []
        self.rng = StepRng()  # the RNG state each step starts from (a generator's only while the fit draws from it)
        #: the device a step's values are made on, fixed at train start (the loop's is a chain of properties)
        self.device: torch.device | None = None

    # ------------------------------------------------------------------ lifecycle

    def attach(self, module: torch.nn.Module) -> None:
        """Create the op guard and register the output hooks (before any ``torch.compile`` runs)."""
        if "ops" in self.check:
            self.opguard = OpGuard(check_cpu_calls=False)  # CPU kernels check their own inputs: see OpGuard
            self.opguard.enabled = False
            self.opguard.module_resolver = self._calling_module
            self.opguard.hold()  # the functions stay wrapped for the fit: a step only pushes the guard
        if "outputs" in self.check:
            self.watch = OutputWatch(module, self.watch_modules, self.ignore_modules, self.watch_depth)
            self.watch.attach()
        self._module_names = {id(m): n for n, m in module.named_modules()}

    def detach(self) -> None:
        """Leave the op guard's mode and remove every hook (idempotent)."""
        self.exit_ops()
        if self.opguard is not None:
            self.opguard.release()
        if self.watch is not None:
            self.watch.detach()

    def at_train_start(self, loop: Loop) -> None:
        """The fit's device, once the loop has put the module on it (``None`` before: each step asks the loop)."""
        self.device = loop.device

    def copy_starts(
        self, copies: tuple[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]], stateful: dict[str, Any]
    ) -> None:
        """Once per fit: the storage each step's start copies of the buffers go into (copies, live buffers, copies
        by name), and the metric states of ``stateful`` kept at each step's start."""
        self.start_copies = copies
        self.metric_keys = [k for k in stateful if k.startswith("metric:")]

    # ------------------------------------------------------------------ recording

    def begin(
        self,
        loop: Loop,
        batch: Any,
        batch_idx: int,
        keep_start: bool,
        stateful: dict[str, Any],
    ) -> StepRecord:
        """Start (or continue, within an accumulation window) the step record of ``batch``."""
        rec = self.record
        if rec is None:
            rec = self.record = StepRecord(epoch=loop.epoch, batch_idx=batch_idx, batch=batch)
            if self.watch is not None:  # forget outputs recorded between steps (a retry after a rollback)
                self.watch.reset()
            if keep_start:
                copies, live, by_name = self.start_copies
                if copies:  # one fused copy of every buffer, into storage reused each step
                    _compat.foreach_copy_(copies, live)
                rec.start_buffers = by_name
                # numpy's RNG is left to the snapshot: reading its state costs ~0.1 ms, more than all the rest
                rec.start_states = clone_states(stateful, self.metric_keys) if self.metric_keys else {}
                rec.start_rng = self.rng.at_step_start()
        micro = _micro.MicroBatch(batch_idx, batch, first_output=self.watch.count() if self.watch is not None else 0)
        if rec.start_rng is not None:
            micro.rng = _micro.micro_rng(rec.start_rng) if rec.micro else rec.start_rng
        rec.micro.append(micro)
        if self.extra_checks:
            rec.check_step = CheckStep(loop, batch, batch_idx, loop.step)
            rec.checks = _extra.record(self.extra_checks, "batch_start", rec.check_step, rec.checks)
        if self._inputs:
            leaves = floating_leaves(batch)
            if self.ignored_inputs:
                leaves = [(p, t) for p, t in leaves if p not in self.ignored_inputs]
            if leaves:
                # one aminmax per tensor; the read reduces the ends (on the host when one process reads them)
                ends = checks.input_ends(list(map(_TENSOR, leaves)), self.device or loop.device)
                rec.inputs.append((leaves, ends))
                micro.inputs = ends[0][1] if len(ends) == 1 else [v for _, values in ends for v in values]
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
        """Keep the loss of this micro-batch for the step's read; the forward's watched outputs are reduced now, so the
        watch holds none of them through the backward pass."""
        if self.watch is not None:
            self.watch.settle()
        rec = self.record
        if rec is not None and rec.check_step is not None:
            rec.check_step = replace(rec.check_step, loss=loss.detach())
            rec.checks = _extra.record(self.extra_checks, "loss", rec.check_step, rec.checks)
        if self._loss and rec is not None:
            loss = loss.detach()
            rec.losses.append(loss if type(loss) is torch.Tensor else local(loss))  # a DTensor (loss parallel): a shard
            if rec.micro:
                rec.micro[-1].loss = rec.losses[-1]

    def at_optimizer_step(self, optimizer: Any) -> None:
        """Record the checks passed as ``extra_checks`` that look at the step before its optimizer step."""
        rec = self.record
        if rec is not None and rec.check_step is not None:
            rec.check_step = replace(rec.check_step, optimizer=optimizer)
            rec.checks = _extra.record(self.extra_checks, "optimizer_step", rec.check_step, rec.checks)

    # ------------------------------------------------------------------ what the other parts found

    def force_skip(self, reason: str, rec: StepRecord | None = None) -> None:
        """Skip ``rec`` (the step in progress by default) whatever its read finds; the first reason stands."""
        rec = rec if rec is not None else self.record
        if rec is not None and not rec.skip_forced:
            rec.forced_skip = reason

    def flag_quarantine(self, flag: torch.Tensor | None) -> None:
        """Fold a micro-batch's quarantine flag (0-d, on the device; ``None``: not quarantined) into the step's."""
        rec = self.record
        if rec is not None and flag is not None:
            rec.quarantine_flag = _micro.merged_flag(rec.quarantine_flag, flag)

    def mark_read(self, step: int, seen: bool = False) -> None:
        """The step's flags are read (or packed) at optimizer step ``step``; ``seen``: what was recorded up to now
        is noted, a further optimizer of the batch reads only what comes after (manual optimization)."""
        rec = self.record
        assert rec is not None
        rec.read_done = True
        if seen:
            rec.seen_at_read = (len(rec.losses), self.watch.count() if self.watch is not None else 0)
        rec.step = step

    def mark_spike_read(self) -> None:
        """The spike statistics' values went into a read of this step (its first read only)."""
        assert self.record is not None
        self.record.spike_read = True

    @staticmethod
    def settle(rec: StepRecord, decision: Decision, events: list[dict[str, Any]]) -> None:
        """A read of ``rec`` judged: its decision (a further optimizer's clean read keeps the first's) and events."""
        if rec.decision is None or decision.action != "none":
            rec.decision = decision
        rec.events = rec.events + events

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
        self.record.inputs = []
        self.record.checks = {}  # the further optimizer's own checks are recorded again at its step
        self.record.losses = self.record.losses[n_losses:]
        if self.watch is not None:
            self.watch.records[:n_outputs] = []
        if self.opguard is not None:
            self.opguard.reset()

    def keep(self) -> tuple[Any, list[Any]]:
        """This step's watch records (a device copy of the watch's small buffer) and op-guard records, kept to
        name the block and the op call when the step is read late (no sync)."""
        watch, opguard = self.watch, self.opguard
        return (
            watch.keep() if watch is not None and watch.enabled else None,
            opguard.records if opguard is not None else [],  # reset() starts a new list: this one stays
        )

    def point_to_bad_micro_batch(self, loop: Loop | None = None) -> None:
        """Under gradient accumulation, make ``record.batch``/``batch_idx``/``start_rng`` the first bad micro-batch's.

        See :func:`~lightning_numguard.engine.micro.first_bad` (syncs, after a hit only; collective with
        ``loop`` under DDP).
        """
        rec = self.record
        if rec is None or len(rec.micro) < 2:
            return
        first = _micro.first_bad(loop, rec, self.watch)
        rec.bad_micro_batch = first
        rec.batch, rec.batch_idx = rec.micro[first].batch, rec.micro[first].batch_idx
        rec.start_rng = rec.micro[first].rng or rec.start_rng

    def _calling_module(self) -> str | None:
        """The innermost module whose code is running (called only at guarded ops, a few per step).

        Walking the Python frames here replaces a pre-hook on every module's forward.
        """
        return _compat.calling_owner(self._module_names, 2)
