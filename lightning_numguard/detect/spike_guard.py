"""Spike statistics and overflow headroom in the step's one read: ``NumGuardCallback(spike_action=...)``.

:class:`SpikeGuard` holds one fit's :class:`~lightning_numguard.detect.spike.SpikeWindow` (the device ring of
the loss and the global gradient norm) and what the host knows of it (the steps that spiked, the blocks
already reported near their dtype's limit). Each optimizer step:

1. :meth:`~SpikeGuard.extras` (in ``StepRead.slot_values``, no sync): this rank's loss, the global
   gradient norm, the window's statistics (each series' center and raw threshold, as the window was before this
   step) and the largest overflow-headroom ratio of a block not reported yet, as ten float32 values that ride
   after the flag slots in the step's one packed vector (the same ``MAX`` all-reduce: the loss becomes the largest
   of the ranks'; the gradient norm, the same on every rank after DDP's all-reduce, stays as it is, and so do the
   statistics), as 0-d values in the step's one ``stack`` of the flags. One process reading on the host: the loss
   and the gradient norm come from the host (:meth:`~SpikeGuard.take_host_row`), the headroom too
   (:meth:`~SpikeGuard.host_headroom`, of the watched calls' values the read holds), the rest are views; the
   statistics are recomputed every :data:`REFRESH_EVERY` steps (issue 25's budget: at most 4 device ops a step,
   measured by ``benchmarks/spike_ops.py``);
2. after the read (``sync_mode="every_step"``): :meth:`~SpikeGuard.findings` scores the host-read values on the
   host (:func:`~lightning_numguard.detect.spike.judge`) into ``loss_spike`` / ``grad_norm_spike`` and
   ``overflow_risk`` findings; in ``sync_mode="deferred"`` :meth:`~SpikeGuard.device_flag` (a raw value above its
   threshold) joins the device-side skip through ``found_inf`` and the findings come with the late read;
3. at batch end, :meth:`~SpikeGuard.push` moves the window on (several processes: it takes the reduced values;
   no sync), and :meth:`~SpikeGuard.scalars` gives ``numguard/grad_norm``, ``numguard/loss_zscore`` and
   ``numguard/grad_norm_zscore`` to the series (:mod:`~lightning_numguard.reporting.series`: Lightning's
   logging steps and every event step; host numbers already read: no sync).

The window is in the callback's checkpoint state (resume) and, as a stateful object of the snapshots, is put
back by a rollback.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from lightning_numguard.detect import spike
from lightning_numguard.detect.spike import NOT_JUDGED, SpikeWindow
from lightning_numguard.diagnose.findings import Finding, mark_consequences
from lightning_numguard.reporting.events import SPIKE_ACTIONS

__all__ = ["SPIKE_ACTIONS", "SpikeGuard"]

log = logging.getLogger(__name__)

#: ``NumGuardCallback(spike_action=...)`` values besides ``None``.
#: The stateful name of the window in snapshots.
STATEFUL_KEY = "numguard:spike_window"
#: Steps between refreshes of the window's statistics (each step's value is scored against them), at most a quarter
#: of the window. Refreshing costs about 25 device ops; a step otherwise 1 (issue 25's budget: at most 4 a step).
REFRESH_EVERY = 32
#: Steps between looks at the watched blocks' headroom (activations creep towards a limit over many steps).
HEADROOM_EVERY = 8


class SpikeGuard:
    """Spike statistics and overflow headroom of one fit.

    Args:
        action: ``None`` (statistics and loggers only), ``"warn"``, ``"skip"`` or ``"rollback"``.
        sigma: z-score above which a value is a spike.
        window: steps in the rolling window (0: no spike statistics).
        warmup: valid values the window needs before it judges.
        rollback_after: under ``"skip"``, the number of spikes within ``window`` steps that makes a spike
            roll back instead (0: never).
        headroom: a watched block whose output peak reaches ``dtype max / headroom`` is reported once
            (``None``: off).
    """

    def __init__(
        self,
        action: str | None,
        sigma: float,
        window: int,
        warmup: int,
        rollback_after: int,
        headroom: float | None,
    ) -> None:
        self.action = action
        self.sigma = sigma
        refresh = max(1, min(REFRESH_EVERY, window // 4))  # a short window is refreshed within a quarter of it
        self.window = SpikeWindow(window, warmup, refresh, sigma) if window > 0 else None
        self.rollback_after = rollback_after
        self.headroom = headroom
        #: whether a step carries the extras at all (a window or a headroom)
        self.enabled = self.window is not None or headroom is not None
        self.spike_steps: list[int] = []  # steps that spiked (host), for the escalation to a rollback
        self.reported: set[str] = set()  # blocks (and "loss_scale") already reported near overflow
        self._masks: dict[Any, torch.Tensor] = {}  # per watch buffer: blocks reported, on the device
        self._layout: list[tuple[Any, int]] = []  # this step's watch buffers, in the order laid end to end
        self.reduced: torch.Tensor | None = None  # this step's reduced extras, on the device (for push)
        self.last: tuple[int, list[float]] | None = None  # the latest host-read extras and their step
        # per device: NaN, the not-judged scores, the headroom's and the ranks' defaults (views made once)
        self._constants: dict[
            torch.device, tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
        ] = {}
        self._marks: dict[tuple[torch.device, int, int], torch.Tensor] = {}  # per device, rank and world: world - rank
        self._calls = 0
        self._single = True  # one process: the raw values need no mark for the reduce
        self._host_row: tuple[float, float] | None = None  # this step's loss and gradient norm, read on the host
        self._stats_unbound: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None  # see _stats_views
        #: one process reading on the host: the window statistics it last read, and their device tensor
        self._host_stats: tuple[torch.Tensor | None, list[float]] | None = None
        self._stats_read: torch.Tensor | None = None  # the statistics whose values this step's read carries
        self.host_headroom_due = False  # this step's headroom is the host's, of the read's output values
        self._scored: tuple[list[float], list[float | None]] | None = None  # see scores_of

    @property
    def acting(self) -> bool:
        """Whether a spike skips the step (``"skip"`` or ``"rollback"``)."""
        return self.window is not None and self.action in ("skip", "rollback")

    def arming(self, max_steps: int, start_step: int) -> tuple[str | None, str | None]:
        """What fit start says when ``spike_action`` is set: the line "spike detection arms after N steps", and a
        warning when the fit ends (``max_steps``; -1: no limit) before the window can judge."""
        if self.window is None or self.action is None:
            return None, None
        warmup = self.window.warmup
        line = (
            f"NumGuard: spike detection (spike_action={self.action!r}) arms after {warmup} steps (spike_warmup) and "
            f"judges each step against the last {self.window.window} (spike_window)"
        )
        if 0 <= max_steps < start_step + warmup:
            return line, (
                f"spike detection cannot act in this fit: max_steps={max_steps} ends it before the spike window holds "
                f"spike_warmup={warmup} steps; lower spike_warmup to judge sooner (at least 8 keeps false spikes rare)"
            )
        return line, None

    # ------------------------------------------------------------------ on the device

    def extras(
        self,
        loss: torch.Tensor | None,
        grad_norm: torch.Tensor | None,
        watch: Any,
        device: torch.device,
        rank: int = 0,
        world: int = 1,
        host_row: bool = False,
    ) -> list[torch.Tensor]:
        """The :data:`~lightning_numguard.detect.spike.EXTRAS` of this rank, before the reduce, as 0-d values that the
        step's one ``stack`` lays after the flags (``core.flags.stack_raw`` / ``pack``); no sync.

        One process: the loss and the gradient norm are written straight into the window's next row (one ``stack``),
        or, ``host_row`` (the step's read is on the host: the gradient norm is the host's, of the per-tensor norms),
        given by the host after the read (:meth:`take_host_row`, one copy at :meth:`push`); the statistics are
        recomputed every :data:`REFRESH_EVERY` steps, the headroom looked at every :data:`HEADROOM_EVERY` steps;
        everything else is a view. With ``host_row`` only statistics the host has not read yet are returned (the four
        views after a refresh, else nothing): the host lays out the rest itself (:meth:`host_extras`). Under several
        processes the window takes the values reduced across ranks, at :meth:`push`.
        """
        self._calls += 1
        due = self.headroom is not None and self._calls % HEADROOM_EVERY == 1 and watch is not None and watch.records
        self._single = world == 1
        window = self.window
        if window is not None and window.values.device != device:
            window.to(device)
        if self._single and host_row:  # the host holds all but new statistics: see host_extras
            # the host's read holds every watched call's max-|x|: it takes the headroom of them (host_headroom)
            self.host_headroom_due = bool(due)
            self._host_row = None  # until the read gives it
            if window is None:
                return []
            current = window.stats()  # the window before this step
            held = self._host_stats
            if held is not None and held[0] is current:
                return []
            self._stats_read = current
            return list(self._stats_views(current))
        self.host_headroom_due = False
        const = self._constants.get(device)
        if const is None:  # [NaN, 0 x2, +inf x2, 0, -1, 0, 0]: reused every step
            values = torch.tensor([math.nan, 0.0, 0.0, math.inf, math.inf, 0.0, -1.0, 0.0, 0.0], device=device)
            const = self._constants[device] = (values[0], values[1:5], values[5:7].unbind(), values[7:9].unbind())
        nan, no_stats, no_head, no_ranks = const  # no_stats: centers 0, thresholds +inf (nothing judged)
        head = self._headroom(watch, device) if due and not host_row else no_head
        loss = nan if loss is None else loss if loss.dim() == 0 else loss.reshape(())
        grad_norm = nan if grad_norm is None else grad_norm
        if self._single:
            if window is None:
                return [_f32(loss), _f32(grad_norm), nan, nan, no_stats[2], no_stats[3], *head, *no_ranks]
            stats = self._stats_views(window.stats())  # the window before this step
            row = window.write(_f32(loss), _f32(grad_norm))
            return [*row.unbind(), *stats, *head, *no_ranks]
        raw = torch.stack([loss, grad_norm]).float()
        # a finite mark for "missing" survives the MAX all-reduce; NaN might not
        raw = raw.nan_to_num(nan=NOT_JUDGED, posinf=NOT_JUDGED, neginf=NOT_JUDGED)
        judged = window.stats() if window is not None else no_stats
        mark = self._marks.get((device, rank, world))
        if mark is None:  # this rank's mark, made once
            mark = self._marks[(device, rank, world)] = torch.tensor(float(world - rank), device=device)
        ranks = torch.stack([raw[0] > judged[2], head[1] >= 0]) * mark  # the mark where seen, else 0
        return [*raw.unbind(), *judged.unbind(), *head, *ranks.unbind()]

    def host_extras(self, loss: float, read: list[float]) -> list[float]:
        """One process reading on the host (:meth:`extras` with ``host_row``): the :data:`~lightning_numguard.detect.
        spike.EXTRAS` as host numbers, of the step's ``loss`` as read in its slot (NaN: none) and the values
        :meth:`extras` put in the read (``read``). Only new statistics go through the read (every
        :data:`REFRESH_EVERY` steps, and after a restore); the host keeps them until the next. The gradient norm is
        NaN until the host's own takes its place, the headroom not looked at (``0.0, -1.0``) until the host's does,
        the ranks 0."""
        if read:
            self._host_stats = (self._stats_read, read)
        held = self._host_stats
        stats = held[1] if self.window is not None and held is not None else _NO_STATS
        return [loss, math.nan, *stats, 0.0, -1.0, 0.0, 0.0]

    def _stats_views(self, stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The window statistics' four values as views, made again only when the statistics are (every
        :data:`REFRESH_EVERY` steps): a view costs the host a microsecond or two each step."""
        if self._stats_unbound is None or self._stats_unbound[0] is not stats:
            self._stats_unbound = (stats, stats.unbind())
        return self._stats_unbound[1]

    def _headroom(self, watch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.headroom is not None
        ranges = [(key, rows) for key, rows in watch.ranges() if key[1] in spike.DTYPE_MAX]
        self._layout = [(key, rows.shape[0]) for key, rows in ranges]
        masks = []
        for key, rows in ranges:
            mask = self._masks.get(key)
            if mask is None:
                mask = self._masks[key] = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
            masks.append(mask)
        ratio, index = spike.headroom([(key[1], rows) for key, rows in ranges], masks, self.headroom)
        return ratio.to(device), index.to(device)

    def host_headroom(self, peaks: list[tuple[Any, list[float]]], names: list[str]) -> tuple[float, float]:
        """One process reading on the host, when the headroom is due: :func:`~lightning_numguard.detect.spike.headroom`
        of the host-read block peaks (``OutputWatch.host_ranges``: per output dtype, each block's largest max-|x|),
        the ``overflow_ratio`` and ``overflow_block`` of the host-read extras, in the device's layout (the buffers
        laid end to end); a block already reported is left out, as the device's masks leave it out. No op."""
        self.host_headroom_due = False
        assert self.headroom is not None
        best, index, at = 0.0, -1, 0
        self._layout = []
        for key, rows in peaks:
            limit = spike.DTYPE_MAX.get(key[1])
            if limit is None:
                continue
            self._layout.append((key, len(rows)))
            for slot, peak in enumerate(rows):
                ratio = peak / limit
                if ratio > best and math.isfinite(ratio) and names[slot] not in self.reported:  # NaN: the NaN guard's
                    best, index = ratio, at + slot
            at += len(rows)
        return best, float(index if best >= 1.0 / self.headroom else -1)

    def device_flag(self, reduced: torch.Tensor) -> torch.Tensor:
        """0-d bool on the device: this step spiked and a spike skips (``sync_mode="deferred"``); no sync."""
        return spike.device_spike(reduced)

    def take_reduced(self, values: torch.Tensor) -> None:
        """This step's extras as the read reduced them (on the device; one process: as stacked), for :meth:`push`."""
        self.reduced = values

    def take_host_row(self, loss: float, grad_norm: float) -> None:
        """This step's host-read loss and gradient norm (one process reading on the host, instead of
        :meth:`take_reduced`), for :meth:`push`."""
        self._host_row = (loss, grad_norm)

    def push(self) -> None:
        """Batch end: this step's loss and gradient norm join the window (one process: already written by
        :meth:`extras`, or the host's row, one copy; several: the values reduced across ranks, the same on every
        rank); no sync."""
        if self.window is not None:
            if self._host_row is not None:
                self.window.push_host(*self._host_row)
            elif self.reduced is not None:
                self.window.push(None if self._single else self.reduced[:2])
        self.reduced = None
        self._host_row = None

    # ------------------------------------------------------------------ on the host

    def findings(
        self, values: list[float], step: int, watch: Any, world: int = 1
    ) -> tuple[list[Finding], list[Finding]]:
        """``(spikes, overflow risks)`` of host-read extras (``values``) of ``step``, the same on every rank (the
        loss's and the block's rank: the lowest that saw them; the gradient norm's: 0, it is every rank's)."""
        self.last = (step, values)
        loss_rank = world - round(values[8]) if values[8] > 0 else 0
        spikes: list[Finding] = []
        if self.window is not None and self.action is not None and self.crossed(values):  # (else judge finds none)
            held = self.window.count  # the steps the window spanned when it scored this one (host)
            for name, value, z in spike.judge(values, self.sigma, self.scores_of(values)):  # scored once a read
                details = {
                    "value": value,
                    "zscore": round(z, 2),
                    "sigma": self.sigma,
                    "window": held,
                    "window_size": self.window.window,
                    "rule": "cube root > median + sigma x max((95th percentile - median) / 1.645, median / 10)",
                }
                spikes.append(Finding(f"{name}_spike", [name], details, loss_rank if name == "loss" else 0))
            spikes = mark_consequences(spikes)  # a loss and a gradient norm spiking together are one incident
        if self.headroom is None or values[7] < 0:  # no block near its dtype's limit (the usual step)
            return spikes, []
        return spikes, self._overflow(values, watch, world - round(values[9]) if values[9] > 0 else 0)

    def _overflow(self, values: list[float], watch: Any, rank: int) -> list[Finding]:
        ratio, index = values[6], int(values[7])
        if self.headroom is None or index < 0 or watch is None or not self._layout:
            return []
        key = None
        for buffer_key, n in self._layout:  # the buffers laid end to end: which one, which row
            if index < n:
                key = buffer_key
                break
            index -= n
        if key is None:
            return []
        mask = self._masks.get(key)
        if mask is not None:  # on the device, from a host index: no sync (the host's headroom reads the names)
            mask[index] = True
        name = watch.names[index]
        if name in self.reported:
            return []
        self.reported.add(name)
        limit = spike.DTYPE_MAX[key[1]]
        dtype = str(key[1]).replace("torch.", "")
        details = {
            "peak": ratio * limit,
            "dtype": dtype,
            "limit": limit,
            "headroom": (1.0 / ratio) if ratio > 0 else math.inf,
            "factor": self.headroom,
        }
        return [Finding("overflow_risk", [name], details, rank)]

    def loss_scale_finding(self, message: str) -> Finding | None:
        """A collapsing fp16 loss scale as an ``overflow_risk`` finding, once per fit."""
        if "loss_scale" in self.reported:
            return None
        self.reported.add("loss_scale")
        return Finding("overflow_risk", ["loss_scale"], {"loss_scale_collapse": message})

    def decide(self, step: int) -> str:
        """The action for a spike at ``step`` (escalated), and remember the step."""
        assert self.window is not None
        assert self.action is not None
        action = spike.escalate(self.action, self.spike_steps, step, self.window.window, self.rollback_after)
        self.spike_steps = [s for s in self.spike_steps if s > step - self.window.window] + [step]
        return action

    def take_last(self) -> tuple[int, list[float]] | None:
        """The latest host-read extras and their step, once (``None``: no read since the last call)."""
        last, self.last = self.last, None
        return last

    def scalars(self, values: list[float]) -> dict[str, float]:
        """``numguard/grad_norm`` and the z-scores of host-read extras ``values``, for the run's series (no read)."""
        metrics: dict[str, float] = {}
        if math.isfinite(values[1]) and values[1] > NOT_JUDGED:
            metrics["numguard/grad_norm"] = float(values[1])
        for z, tag in zip(self.scores_of(values), ("numguard/loss_zscore", "numguard/grad_norm_zscore")):
            if z is not None:
                metrics[tag] = float(z)
        return metrics

    def crossed(self, values: list[float]) -> bool:
        """Whether a z-score of host-read extras ``values`` is above ``sigma``: computed only where a raw value reaches
        its raw threshold (the cube root is monotonic; the margin covers rounding), else two pairs of floats."""
        loss, grad_norm, _, _, top_loss, top_grad_norm = values[:6]
        if not (loss >= top_loss - abs(top_loss) * 1e-6 or grad_norm >= top_grad_norm - abs(top_grad_norm) * 1e-6):
            return False
        return any(z is not None and z > self.sigma for z in self.scores_of(values))

    def scores_of(self, values: list[float]) -> list[float | None]:
        """:func:`~lightning_numguard.detect.spike.scores` of host-read extras ``values`` (``None``: not judged),
        computed once per read: the judgement, :meth:`crossed` and :meth:`scalars` share them."""
        scored = self._scored
        if scored is None or scored[0] is not values:
            scored = self._scored = (values, spike.scores(values, self.sigma))
        return scored[1]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Plain types for the checkpoint. **Syncs** (checkpoints only)."""
        state: dict[str, Any] = {"spike_steps": list(self.spike_steps)}
        if self.window is not None:
            state["window"] = self.window.to_plain()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a checkpoint without it leaves the fresh window. A malformed state raises
        before anything is changed (the window validates before it assigns)."""
        spike_steps = [int(s) for s in state.get("spike_steps", [])]
        if self.window is not None and state.get("window"):
            self.window.load_state_dict(state["window"])
        self.spike_steps = spike_steps


#: the statistics of no window, as host numbers: centers NaN, thresholds +inf (nothing judged)
_NO_STATS = (math.nan, math.nan, math.inf, math.inf)


def _f32(value: torch.Tensor) -> torch.Tensor:
    return value if value.dtype == torch.float32 else value.float()
