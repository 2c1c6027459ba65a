"""The step's one read: names resolved once per fit, per-segment plans, the packed flags and their reduce.

:class:`StepRead` turns what the step recorded (:class:`~lightning_numguard.engine.record.StepRecord`) and
the state it checks (gradients, parameters, buffers, optimizer state) into the 0-d slot values of
:mod:`~lightning_numguard.detect.flags`, packs them with the spike statistics' values, all-reduces them across
ranks in one call and reads them back once (:meth:`~StepRead.read`); ``sync_mode="deferred"`` stops before the
host read (:meth:`~StepRead.pack`). After a hit, :meth:`~StepRead.confirmed` and
:meth:`~StepRead.state_bad_where` look at the state exactly.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_numguard._compat import flat_norm_f32
from lightning_numguard.detect import checks, flags, spike
from lightning_numguard.detect import extra as _extra
from lightning_numguard.dtensor import local
from lightning_numguard.engine import group as _distributed
from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.record import Named, StepRecorder
from lightning_numguard.engine.tail import Tail

__all__ = ["Reading", "StepRead"]

log = logging.getLogger(__name__)

#: where the overflow headroom's ratio (and after it the block's index) is among the spike statistics' extras
_OVERFLOW_AT = spike.EXTRAS.index("overflow_ratio")
_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")
_PARAMS = operator.itemgetter("params")
_STRIDED = torch.strided
_F32 = torch.float32


@dataclass
class Reading:
    """The decoded flags of one read and the named tensors that went into its ``NORMS`` slot."""

    flags: flags.StepFlags
    segments: dict[str, Named] = field(default_factory=dict)
    #: the host-read spike extras after the flag slots (``core.spike.EXTRAS``), when the step carried them
    extras: list[float] = field(default_factory=list)


class StepRead:
    """Packs a step's flags, reduces them across ranks and reads them once; looks at the state exactly after a hit.

    Args:
        check: the sites checked every step (``NumGuardCallback(check=...)``).
        max_abs_input: the suspicious-input threshold, or ``None``.
        recorder: the step record and its instruments.
    """

    def __init__(
        self, check: list[str], max_abs_input: float | None, recorder: StepRecorder, spike: Any = None
    ) -> None:
        self.check = check
        self.max_abs_input = max_abs_input
        every_buffer = "buffers" in check or "params" in check
        self._every_buffer = every_buffer
        self._check_grads = "grads" in check
        #: the state segments of a step's total, by whether the snapshot is due (every one of them then); buffers
        #: as they were before the forward pass are ``start_buffers``
        checked = {"params": "params" in check, "start_buffers": every_buffer, "opt_state": "optimizer_state" in check}
        self._wanted = {due: [name for name, on in checked.items() if on or due] for due in (False, True)}
        #: state checked at every step besides the buffers (whose start-of-step copies are known per fit)
        self._state_every_step = checked["params"] or checked["opt_state"]
        self.recorder = recorder
        self.extra = recorder.extra_checks  # the checks passed as extra_checks: a value each after the slots
        self.extras_at = flags.extras_at(len(self.extra))  # where the spike statistics' extras start
        self.acting_flags = len(flags.SLOTS) + sum(not c.advisory for c in self.extra)  # values that make a step bad
        self.named_params: Named = []
        self.param_names: dict[int, str] = {}
        self._named_buffers: Named = []
        self._start_checked: Named = []  # checked buffers paired with their start-of-step copies
        self.unchecked_buffers: set[str] = set()
        self.checked_buffers: Named = []
        # Per optimizer: its param groups' lists and their lengths (the key), the names and parameters checked, and
        # their plan.
        self._opt_params: dict[
            int, tuple[Any, list[list[Any]], list[int], list[str], list[torch.Tensor], checks.TotalPlan]
        ] = {}
        #: the segments of the last ``NORMS`` total and their totals on the device (see :meth:`norm_total`)
        self.norm_parts: tuple[list[str], torch.Tensor] | None = None
        self._grads_plan: checks.TotalPlan | None = None  # the plan of the gradients grads() last returned
        self._grads: list[torch.Tensor] = []  # those gradients, when the plan applies
        # per state segment: its named list, its tensors and their plan, kept while the list is the same object
        self._segment_plans: dict[str, tuple[Named, list[torch.Tensor], checks.TotalPlan]] = {}
        self._opt_state: tuple[list[torch.Tensor], Named] | None = None  # the optimizer state tensors, named
        # Whether parameters, buffers and optimizer state may go through the CPU's fused check, which writes the
        # same bits back: not while a snapshot copies them on another thread (set at train start)
        self.state_rewritable = False
        # Spike statistics and overflow headroom (callbacks/step/_spike.SpikeGuard), or None: their values ride after
        # the flag slots in the one read; the global gradient norm is the grads' check
        self.spike: Any = spike
        #: the step's global gradient L2 norm (0-d, on the device) when the spike statistics carry it, else ``None``
        self.grad_norm: torch.Tensor | None = None
        self._zeros: dict[torch.device, torch.Tensor] = {}
        #: the gradients' check is their L2 norm, which the spike statistics need (one process: each to the host)
        self._grads_by_norm = spike is not None and spike.window is not None

    @property
    def plan_applies(self) -> bool:
        """Whether the gradients :meth:`grads` last returned are every gradient of the optimizer's checked parameters,
        so :meth:`norm_total` checks them with the plan resolved once per optimizer (no per-tensor grouping)."""
        return self._grads_plan is not None

    @property
    def start_buffer_map(self) -> dict[str, torch.Tensor]:
        """The start-of-step copies of the persistent buffers, by name (storage reused every step)."""
        return self.recorder.start_copies[2]

    # ------------------------------------------------------------------ per fit

    def resolve(self, module: torch.nn.Module, stateful: dict[str, Any]) -> None:
        """Resolve names once per fit: the hot path must not walk the module tree every step."""
        self.named_params = list(module.named_parameters())
        self.param_names = {id(p): n for n, p in self.named_params}
        self._opt_params = {}
        self._segment_plans = {}
        self._opt_state = None
        persistent = set(module.state_dict())
        self._named_buffers = [(n, b) for n, b in module.named_buffers() if n in persistent]
        copies = [b.detach().clone() for _, b in self._named_buffers]
        by_name = {n: c for (n, _), c in zip(self._named_buffers, copies)}
        self.recorder.copy_starts((copies, [b for _, b in self._named_buffers], by_name), stateful)

    def allow_rewrite(self, allowed: bool) -> None:
        """Train start: whether the state may go through the CPU's fused check, which writes the same bits back
        (not while a snapshot copies it on another thread)."""
        self.state_rewritable = allowed

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
        self._start_checked = [(n, self.start_buffer_map[n]) for n, _ in self.checked_buffers]
        return [n for n in bad_at_start if n not in self.unchecked_buffers]

    # ------------------------------------------------------------------ the read

    def read(self, loop: Loop, optimizer: Any, snapshot_due: bool, step: int | None = None) -> Reading:
        """Pack every flag of the step, all-reduce once, read once (the step's one host sync); ``step``: the loop's
        step, when the caller has it."""
        self.recorder.mark_read(loop.step if step is None else step, seen=True)
        if loop.world_size == 1:  # nothing to reduce: the host judges the raw values (one stack, the step's one read)
            return self._read_here(loop, optimizer, snapshot_due)
        n = self.extras_at
        slots, segments, device_extras = self.slot_values(loop, optimizer, snapshot_due)
        values = self.reduce(loop, slots, device_extras).tolist()  # the one host read of the step
        return Reading(flags.decode(values[:n], loop.world_size), segments, values[n:])

    def _read_here(self, loop: Loop, optimizer: Any, snapshot_due: bool) -> Reading:
        """One process's read: the slots that hold a device value, the spike statistics the host does not hold yet
        and the tail (:class:`Tail`: the inputs' ends, the watched calls' values, the op guard's flags, the
        gradients' norms) in one ``stack``, read once; the host reduces the tail into its slots and decodes them. A
        slot left at the device's constant zero is not stacked but 0.0 on the host (a value stacked costs the host an
        ``unsqueeze``)."""
        rec = self.recorder.record
        assert rec is not None
        device = self.recorder.device or loop.device  # fixed at train start
        watch = self.recorder.watch
        watch = watch if watch is not None and watch.enabled else None
        tail = Tail()
        tail.add_step(rec, watch, self._op_flags(), device)
        stacked: list[torch.Tensor] = []  # the slots that hold a device value, in slot order
        places: list[int] = []  # and their slots
        segments, total = self._norms_here(loop, optimizer, snapshot_due, device, tail)
        if total is not None:
            stacked.append(total)
            places.append(flags.NORMS)
        loss = self._loss_total(rec.losses, device)
        if loss is not None:
            stacked.append(loss)
            places.append(flags.LOSS)
        if rec.quarantine_flag is not None or self.extra:
            self._flag_slots(rec, device, stacked, places)
        carried = self._spike_extras(loop, rec, loss, watch, device, host_row=True)
        read = carried or []  # the spike statistics the host does not hold yet
        n = self.extras_at
        values = [0.0] * n
        if stacked or read or tail.values:
            raw: list[float] = flags.stack_raw([*stacked, *read, *tail.values]).tolist()  # the step's one read
            for slot, value in zip(places, raw):
                values[slot] = value
            values += raw[len(places) :]
        extras: list[float] = []
        if carried is not None:  # the extras as host numbers, in their place (the loss: its slot's, when there)
            values[n : n + len(read)] = extras = self.spike.host_extras(
                values[flags.LOSS] if loss is not None else math.nan, values[n : n + len(read)]
            )
        at = n + len(extras)
        if extras and self.spike.host_headroom_due:  # the blocks' headroom, of the watched calls' values as read
            self._host_headroom(values, at, tail, watch)
        tail.fold(values, at, self.max_abs_input is not None)
        if extras:  # the loss and the gradient norm join the spike window from the host, at batch end
            if tail.grad_norm is not None:
                values[n + 1] = tail.grad_norm
            self.spike.take_host_row(values[n], values[n + 1])
        seen = flags.decode_raw(values[: len(flags.SLOTS)], self.max_abs_input)
        if self.extra:
            seen = flags.StepFlags(seen.ranks + _extra.seen_raw(self.extra, values[len(flags.SLOTS) : n]))
        return Reading(seen, segments, values[n : n + len(extras)])

    def _flag_slots(self, rec: Any, device: torch.device, stacked: list[torch.Tensor], places: list[int]) -> None:
        """One process's quarantine flag and the checks passed as ``extra_checks`` (one value each, after the slots),
        with their places, after the totals in ``stacked``."""
        if rec.quarantine_flag is not None:
            stacked.append(rec.quarantine_flag.to(device))
            places.append(flags.QUARANTINE)
        if self.extra:
            stacked.extend(_extra.slot_values(self.extra, rec.checks, device, self._zero(device)))
            places.extend(range(len(flags.SLOTS), self.extras_at))

    def _host_headroom(self, values: list[float], at: int, tail: Tail, watch: Any) -> None:
        """The overflow headroom of the watched blocks, of the watched calls' values as read (every few steps), in its
        place among the host's extras."""
        start, count = tail.outputs
        assert watch is not None  # due only with a watch that recorded
        peaks = watch.host_ranges(values[at + start : at + start + count])
        ratio = self.extras_at + _OVERFLOW_AT
        values[ratio], values[ratio + 1] = self.spike.host_headroom(peaks, watch.names)

    def _norms_here(
        self, loop: Loop, optimizer: Any, snapshot_due: bool, device: torch.device, tail: Tail
    ) -> tuple[dict[str, Named], torch.Tensor | None]:
        """One process's ``NORMS`` slot: its segments and their device total (:meth:`norm_total`; ``None`` when there
        is none: the gradients alone make the slot, their norms go to the host, in ``tail``). A small model's
        gradients (one CPU group of small tensors, the plan's
        :attr:`~lightning_numguard.detect.checks.TotalPlan.whole_flat`) take one norm."""
        if (
            snapshot_due
            or self._state_every_step
            or self._start_checked
            or not self._check_grads
            or optimizer is None
            or (self._every_buffer and self.checked_buffers)
        ):
            segments = self._segments(loop, optimizer, snapshot_due)
        else:  # the usual step: the gradients alone
            segments = {"grads": self.grads(optimizer)}
            plan = self._grads_plan
            if plan is not None and plan.whole_flat and self._grads_by_norm:
                norm = flat_norm_f32(self._grads)  # spike.tensor_norms of the plan's one flat group, without the walk
                tail.add_norms([norm if norm.device == device else norm.to(device, non_blocking=True)])
                self.norm_parts = self.grad_norm = None
                return segments, None
        zero = self._zero(device)
        total = self.norm_total(segments, device, zero, tail)
        return segments, None if total is zero else total

    def pack(self, loop: Loop, optimizer: Any, snapshot_due: bool) -> torch.Tensor:
        """The step's reduced flag vector on the device, without its host read (``sync_mode="deferred"``), followed
        by the spike statistics' raw values when the step carries them (the same all-reduce)."""
        self.recorder.mark_read(loop.step)
        slots, _, extras = self.slot_values(loop, optimizer, snapshot_due)
        return self.reduce(loop, slots, extras)

    def reduce(self, loop: Loop, slots: dict[str, torch.Tensor], extras: list[torch.Tensor] | None) -> torch.Tensor:
        """The rank-encoded flag vector with the spike statistics' 0-d raw values (``extras``) after it, all-reduced
        (``MAX``) across ranks in one call, on the device; the statistics' reduced values go to the spike guard."""
        n = self.extras_at
        packed = flags.pack_slots(list(slots.values()), extras or ())  # the extras in the one stack, not rank-encoded
        packed = flags.encode_rank(packed, loop.rank, loop.world_size, width=n)
        reduced = _distributed.reduce_max(loop, packed)
        if extras is not None:
            self.spike.take_reduced(reduced[n:])
        return reduced

    def slot_values(
        self, loop: Loop, optimizer: Any, snapshot_due: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, Named], list[torch.Tensor] | None]:
        """The step's 0-d slot values on the device, in :data:`~lightning_numguard.detect.flags.SLOTS` order, named as
        :func:`~lightning_numguard.detect.flags.pack`'s arguments, and the named tensors of its ``NORMS`` slot; no sync.

        The read of several ranks and :meth:`pack` (one process's read lays most of these values in its one vector
        as they are: :meth:`_read_here`); the third value is the spike statistics' 0-d extras (or ``None``). The
        inputs' ends, the watched outputs' values and the op guard's flags are reduced here, on the device, and the
        ``suspicious`` slot is the comparison's bool.
        """
        rec = self.recorder.record
        assert rec is not None
        device = loop.device
        segments = self._segments(loop, optimizer, snapshot_due)
        zero = self._zero(device)
        unmasked = zero  # non-finite exactly when an input is: the input slot's total too (no second reduction)
        if rec.inputs:
            unmasked = checks.unmasked_of([group for _, ends in rec.inputs for group in ends], device)
        watch = self.recorder.watch
        watch = watch if watch is not None and watch.enabled else None
        op_flags = self._op_flags()
        loss = self._loss_total(rec.losses, device)
        slots = {
            "input_max": unmasked,
            "norm_total": self.norm_total(segments, device, zero),
            "output_total": watch.total(device) if watch is not None else zero,
            "loss_total": zero if loss is None else loss,
            # a bool, which the pack's stack makes 0.0/1.0 (no op)
            "suspicious": zero if self.max_abs_input is None else unmasked >= self.max_abs_input,
            "op": _any_flag(op_flags, device) if op_flags else zero,
            "quarantine": rec.quarantine_flag.to(device) if rec.quarantine_flag is not None else zero,
        }
        if self.extra:  # the checks passed as extra_checks: a 0/1 flag each, to rank-encode
            values = _extra.as_flags(self.extra, _extra.slot_values(self.extra, rec.checks, device, zero))
            slots.update({f"check:{c.kind}": v for c, v in zip(self.extra, values)})
        return slots, segments, self._spike_extras(loop, rec, loss, watch, device, host_row=False)

    def _segments(self, loop: Loop, optimizer: Any, snapshot_due: bool) -> dict[str, Named]:
        """The named tensors of the step's ``NORMS`` slot, by segment (see :meth:`norm_total`)."""
        segments: dict[str, Named] = {}
        for name in self._wanted[snapshot_due]:
            if named := self.segment(name, loop):
                segments[name] = named
        if self._check_grads and optimizer is not None:
            segments["grads"] = self.grads(optimizer)
        if self._every_buffer:  # buffers after the forward pass (BatchNorm running stats)
            segments["live_buffers"] = self.checked_buffers
        return segments

    def _zero(self, device: torch.device) -> torch.Tensor:
        """A 0-d float32 zero on ``device``, made once (never written to)."""
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), dtype=torch.float32, device=device)
        return zero

    def _op_flags(self) -> list[torch.Tensor]:
        """The op guard's flags of this step's guarded calls (0-d bools on the device)."""
        opguard = self.recorder.opguard
        return [r.flag for r in opguard.records] if opguard is not None and opguard.records else []

    @staticmethod
    def _loss_total(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
        """0-d float32 on ``device``: the step's loss, or the sum of its micro-batches' (``None``: none kept)."""
        if not losses:
            return None
        if len(losses) == 1:
            x = losses[0]
            if x.dtype is _F32 and x.dim() == 0 and x.device == device:  # the usual: the loss as it is (no op)
                return x
        losses = [x if x.dtype is _F32 and x.device == device else x.to(device, _F32) for x in losses]
        return losses[0] if len(losses) == 1 and losses[0].dim() == 0 else torch.stack(losses).sum()

    def _spike_extras(
        self, loop: Loop, rec: Any, loss: torch.Tensor | None, watch: Any, device: torch.device, host_row: bool
    ) -> list[torch.Tensor] | None:
        """The spike statistics' 0-d extras of the step's first read (``None``: the statistics are off, or a further
        optimizer reads its gradients alone)."""
        if self.spike is None or not self.spike.enabled or rec.spike_read:
            return None
        self.recorder.mark_spike_read()
        return self.spike.extras(loss, self.grad_norm, watch, device, loop.rank, loop.world_size, host_row=host_row)

    def norm_total(
        self, segments: dict[str, Named], device: torch.device, zero: torch.Tensor, tail: Tail | None = None
    ) -> torch.Tensor:
        """The ``NORMS`` slot's total of ``segments`` (name -> named tensors: ``"grads"``, ``"params"``,
        ``"start_buffers"``, ``"live_buffers"``, ``"opt_state"``), 0-d float32 on ``device``, non-finite when one of
        them is; ``zero`` when there is nothing to check. No sync. The gradients go through the check that may
        rewrite them (on the CPU: the fused check, which writes the same bits back), the state likewise when
        :attr:`state_rewritable`, else read-only.

        Each segment's :class:`~lightning_numguard.detect.checks.TotalPlan` is kept while the segment is the same
        list object (the parameters and buffers are resolved once per fit, the optimizer state while its
        tensors stay the same): a step does no per-tensor grouping.

        With the spike statistics on, the gradients' check is their global L2 norm; ``tail`` (one process): each
        gradient's norm goes to the host, which takes the global norm of them after the read (:meth:`Tail.fold`).
        """
        self.grad_norm = None
        totals = []
        parts: list[str] = []  # the segment of each total (a late read names the part that went bad)
        for name, named in segments.items():
            if not named:
                continue
            parts.append(name)
            if name == "grads":
                if self._grads_by_norm:  # the spike statistics' global L2 norm is the check
                    plan = self._grads_plan if self._grads_plan is not None else checks.TotalPlan([t for _, t in named])
                    grads = self._grads if self._grads_plan is not None else [t for _, t in named]
                    if plan.local:  # DTensors (FSDP2, tensor parallel): this rank's shards; the reduce takes the max
                        grads = [local(t) for t in grads]
                    groups = plan.grouped(grads)
                    if tail is not None:  # one process: each tensor's norm to the host, which takes their L2 norm
                        tail.add_norms(spike.tensor_norms(groups, device, plan.flat))
                        parts.pop()  # not in the device total
                        continue
                    self.grad_norm = spike.global_norm(groups, device)
                    totals.append(self.grad_norm)
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
            self.norm_parts = None
            return zero
        if len(totals) == 1:
            self.norm_parts = (parts, totals[0])
            return totals[0]
        stacked = torch.stack(totals)
        self.norm_parts = (parts, stacked)  # kept by a late read, to say which part went bad (no kernel of its own)
        return stacked.sum()

    # ------------------------------------------------------------------ exact, after a hit

    def confirmed(self, loop: Loop, reading: Reading, segment: str) -> list[str]:
        """The names in ``segment`` that are exactly non-finite (syncs; after a hit only)."""
        if segment in reading.segments:
            named = reading.segments[segment]
            if not reading.flags.seen(flags.NORMS):  # part of the step's flag, which proved it finite
                return []
        else:  # not checked every step: after a hit, look at it exactly (the root cause may be there)
            named = self.segment(segment, loop)
        if not named:
            return []
        return [n for (n, _), bad in zip(named, checks.confirm_nonfinite([t for _, t in named])) if bad]

    def state_bad(self, loop: Loop, reading: Reading) -> list[str]:
        """Parameters, buffers at the step start and optimizer state that are non-finite on any rank."""
        return self.state_bad_where(loop, reading)[0]

    def state_bad_where(self, loop: Loop, reading: Reading) -> tuple[list[str], int]:
        """:meth:`state_bad`, and the lowest rank where that state was non-finite (``-1`` when none)."""
        names = [n for s in ("params", "start_buffers", "opt_state") for n in self.confirmed(loop, reading, s)]
        return _distributed.first_rank(loop, names)

    # ------------------------------------------------------------------ named tensors

    def grads(self, optimizer: Any) -> Named:
        """The named gradients of ``optimizer``'s parameters.

        The floating, non-empty parameters and their names are resolved once per optimizer (and again when its
        param groups change), with the :class:`~lightning_numguard.detect.checks.TotalPlan` of their layout; a step
        only reads each ``.grad`` (a new tensor each step, with its parameter's dtype and shape) and skips missing
        and sparse ones. When none is skipped, :meth:`read` checks them with that plan.
        """
        groups = optimizer.param_groups
        cached = self._opt_params.get(id(optimizer))
        if cached is None or cached[0] is not optimizer or not _same_groups(groups, cached[1], cached[2]):
            lists = list(map(_PARAMS, groups))
            checked = [p for ps in lists for p in ps if p.is_floating_point() and p.numel() > 0]
            labels = [self.param_names.get(id(p), "?") for p in checked]
            cached = (optimizer, lists, list(map(len, lists)), labels, checked, checks.TotalPlan(checked))
            self._opt_params[id(optimizer)] = cached
        labels, checked, plan = cached[3], cached[4], cached[5]
        grads = list(map(_GRAD, checked))  # no Python loop over the parameters: map and operator run in C
        try:  # every gradient there and dense, in one pass (a missing one has no layout)
            dense = all(map(operator.is_, map(_LAYOUT, grads), itertools.repeat(_STRIDED)))
        except AttributeError:
            dense = False
        if not dense:  # a parameter without a gradient, or a sparse one
            self._grads_plan = None
            return [(n, g) for n, g in zip(labels, grads) if g is not None and g.layout is _STRIDED]
        self._grads_plan, self._grads = plan, grads  # the usual step: the plan applies
        return list(zip(labels, grads))

    def segment(self, segment: str, loop: Loop) -> Named:
        """The named tensors of one state segment, for the step's flag or for an exact look after a hit."""
        if segment == "params":
            return self.named_params
        if segment == "opt_state":
            return self.optimizer_state(loop)
        rec = self.recorder.record
        if segment == "start_buffers" and rec is not None and rec.start_buffers is not None:
            return self._start_checked  # the start-of-step copies live in storage reused every step
        if segment == "live_buffers":
            return self.checked_buffers
        return []

    def state(self, loop: Loop, with_optimizer: bool) -> Named:
        """Parameters and checked buffers (and optimizer state), with names, for a whole-state check."""
        named = list(self.named_params) + [(n, b) for n, b in self._named_buffers if n not in self.unchecked_buffers]
        return named + (self.optimizer_state(loop) if with_optimizer else [])

    def optimizer_state(self, loop: Loop) -> Named:
        """Every optimizer's floating state tensors, named ``optimizer[i].state[<param>].<key>``.

        The named list is kept while every state tensor is the same object (optimizers update their state in
        place; a first step, ``load_state_dict`` or a restore replaces it, and the list is rebuilt): a step
        that checks the optimizer state only walks the tensors, with no names built.
        """
        live = [
            value
            for opt in loop.optimizers
            for state in opt.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        cached = self._opt_state
        if cached is not None and len(cached[0]) == len(live) and all(a is b for a, b in zip(cached[0], live)):
            return cached[1]
        out: Named = []
        for i, opt in enumerate(loop.optimizers):
            for param, state in opt.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and checks.is_checkable(value):
                        out.append((f"optimizer[{i}].state[{self.param_names.get(id(param), '?')}].{key}", value))
        self._opt_state = (live, out)
        return out


def _same_groups(groups: list[dict[str, Any]], lists: list[list[Any]], lengths: list[int]) -> bool:
    """Whether an optimizer's param groups hold the very parameter lists (and lengths) a plan was made from."""
    if len(groups) == 1:  # the usual
        params = groups[0]["params"]
        return len(lists) == 1 and params is lists[0] and len(params) == lengths[0]
    return (
        len(groups) == len(lists)
        and all(map(operator.is_, map(_PARAMS, groups), lists))
        and list(map(len, lists)) == lengths
    )


def _any_flag(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d bool on ``device``: whether any of the op guard's 0-d bool ``flags`` is set (one record: itself, no op; two:
    one ``|``; more: ``stack`` and ``any``); the pack's stack promotes it to 0.0/1.0."""
    flags = [f.to(device) for f in flags]  # no op where a flag is on the device already
    if len(flags) <= 2:
        return flags[0] if len(flags) == 1 else flags[0] | flags[1]
    return torch.stack(flags).any()
