"""Spike statistics and overflow headroom in the step's one read: ``NumGuardCallback(spike_action=...)``.

:class:`SpikeGuard` holds one fit's :class:`~lightning_numguard.core.spike.SpikeWindow` (the device ring of
the loss and the global gradient norm) and what the host knows of it (the steps that spiked, the blocks
already reported near their dtype's limit). Each optimizer step:

1. :meth:`~SpikeGuard.extras` (in ``StepRead.slot_values``, no sync): this rank's loss, the global
   gradient norm, their z-scores against the window, and the largest overflow-headroom ratio of a block not
   reported yet, as eight float32 values that ride after the flag slots in the step's one packed vector (the
   same ``MAX`` all-reduce: the loss becomes the largest of the ranks', its z-score that loss's; the
   gradient norm, the same on every rank after DDP's all-reduce, stays as it is);
2. after the read (``sync_mode="every_step"``): :meth:`~SpikeGuard.findings` turns the host-read values
   into ``loss_spike`` / ``grad_norm_spike`` and ``overflow_risk`` findings; in ``sync_mode="deferred"``
   :meth:`~SpikeGuard.device_flag` joins the device-side skip through ``found_inf`` and the findings come
   with the late read;
3. at batch end, :meth:`~SpikeGuard.push` adds the reduced values to the window (device, no sync) and
   :meth:`~SpikeGuard.scalars` hands ``numguard/grad_norm``, ``numguard/loss_zscore`` and
   ``numguard/grad_norm_zscore`` to the series (:mod:`~lightning_numguard.callbacks._series`: Lightning's
   logging steps and every event step; host numbers already read: no sync).

The window is in the callback's checkpoint state (resume) and, as a stateful object of the snapshots, is put
back by a rollback.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from lightning_numguard.core import spike
from lightning_numguard.core.findings import Finding, mark_consequences
from lightning_numguard.core.spike import NOT_JUDGED, SpikeWindow

__all__ = ["SPIKE_ACTIONS", "SpikeGuard"]

log = logging.getLogger(__name__)

#: ``NumGuardCallback(spike_action=...)`` values besides ``None``.
SPIKE_ACTIONS: tuple[str, ...] = ("warn", "skip", "rollback")
#: The stateful name of the window in snapshots.
STATEFUL_KEY = "numguard:spike_window"
#: Steps between refreshes of the window's median and scale (each step's value is scored against them).
REFRESH_EVERY = 4
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
        self.window = SpikeWindow(window, warmup, REFRESH_EVERY) if window > 0 else None
        self.rollback_after = rollback_after
        self.headroom = headroom
        self.spike_steps: list[int] = []  # steps that spiked (host), for the escalation to a rollback
        self.reported: set[str] = set()  # blocks (and "loss_scale") already reported near overflow
        self._masks: dict[Any, torch.Tensor] = {}  # per watch buffer: blocks reported, on the device
        self._layout: list[tuple[Any, int]] = []  # this step's watch buffers, in the order laid end to end
        self.reduced: torch.Tensor | None = None  # this step's reduced extras, on the device (for push)
        self.last: tuple[int, list[float]] | None = None  # the latest host-read extras and their step
        # per device: NaN, the not-judged scores, the headroom's and the ranks' defaults (views made once)
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._calls = 0
        self._single = True  # one process: the raw values need no mark for the reduce
        self._roots: torch.Tensor | None = None  # this step's values as the window keeps them (one process)

    @property
    def enabled(self) -> bool:
        """Whether a step carries the extras at all."""
        return self.window is not None or self.headroom is not None

    @property
    def acting(self) -> bool:
        """Whether a spike skips the step (``"skip"`` or ``"rollback"``)."""
        return self.window is not None and self.action in ("skip", "rollback")

    # ------------------------------------------------------------------ on the device

    def extras(
        self,
        loss: torch.Tensor | None,
        grad_norm: torch.Tensor | None,
        watch: Any,
        device: torch.device,
        rank: int = 0,
        world: int = 1,
    ) -> torch.Tensor:
        """The :data:`~lightning_numguard.core.spike.EXTRAS` of this rank, before the reduce; no sync.

        A few element-wise ops a step: the window's median and scale are refreshed every
        :data:`REFRESH_EVERY` steps, the headroom is looked at every :data:`HEADROOM_EVERY` steps.
        """
        const = self._constants.get(device)
        if const is None:  # [NaN, NOT_JUDGED x2, 0, -1, 0, 0]: reused every step
            values = torch.tensor([math.nan, NOT_JUDGED, NOT_JUDGED, 0.0, -1.0, 0.0, 0.0], device=device)
            const = self._constants[device] = (values[0], values[1:3], values[3:5], values[5:7])
        nan, not_judged, no_head, no_ranks = const
        raw = torch.stack([nan if loss is None else loss.reshape(()), nan if grad_norm is None else grad_norm])
        if raw.dtype != torch.float32:
            raw = raw.float()
        self._single = world == 1
        if not self._single:  # a finite mark for "missing" survives the MAX all-reduce; NaN might not
            raw = raw.nan_to_num(nan=NOT_JUDGED, posinf=NOT_JUDGED, neginf=NOT_JUDGED)
        z = not_judged
        if self.window is not None:
            roots = self.window.to(device).roots(raw, marked=not self._single)
            z = self.window.scores(raw, roots)
            self._roots = roots  # one process: what push adds, without computing it again
        self._calls += 1
        due = self.headroom is not None and watch is not None and watch.records and self._calls % HEADROOM_EVERY == 1
        head = self._headroom(watch, device) if due else no_head
        if world == 1:  # the lowest rank that saw a spike or a risk can only be this one
            return torch.cat([raw, z, head, no_ranks])
        mark = torch.full((2,), float(world - rank), device=device)
        ranks = torch.where(torch.stack([z[0] > self.sigma, head[1] >= 0]), mark, 0.0)
        return torch.cat([raw, z, head, ranks])

    def _headroom(self, watch: Any, device: torch.device) -> torch.Tensor:
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
        return torch.stack([ratio, index]).to(device)

    def device_flag(self, reduced: torch.Tensor) -> torch.Tensor:
        """0-d bool on the device: this step spiked and a spike skips (``sync_mode="deferred"``); no sync."""
        return spike.device_spike(reduced, self.sigma)

    def push(self) -> None:
        """Batch end: this step's reduced loss and gradient norm join the window; no sync."""
        if self.reduced is not None and self.window is not None:
            if self._single and self._roots is not None:
                self.window.push(roots=self._roots)
            else:  # the values reduced across ranks: the same on every rank
                self.window.push(self.reduced[:2])
        self.reduced = None
        self._roots = None

    # ------------------------------------------------------------------ on the host

    def findings(
        self, values: list[float], step: int, watch: Any, world: int = 1
    ) -> tuple[list[Finding], list[Finding]]:
        """``(spikes, overflow risks)`` of host-read extras (``values``) of ``step``, the same on every rank (the
        loss's and the block's rank: the lowest that saw them; the gradient norm's: 0, it is every rank's)."""
        self.last = (step, values)
        loss_rank = world - round(values[6]) if values[6] > 0 else 0
        spikes: list[Finding] = []
        if self.window is not None and self.action is not None:
            for name, value, z in spike.judge(values, self.sigma):
                details = {
                    "value": value,
                    "zscore": round(z, 2),
                    "sigma": self.sigma,
                    "window": self.window.window,
                    "rule": "cube root > median + sigma x upper-half MAD",
                }
                spikes.append(Finding(f"{name}_spike", [name], details, loss_rank if name == "loss" else 0))
        mark_consequences(spikes)  # a loss and a gradient norm spiking together are one incident
        return spikes, self._overflow(values, watch, world - round(values[7]) if values[7] > 0 else 0)

    def _overflow(self, values: list[float], watch: Any, rank: int) -> list[Finding]:
        ratio, index = values[4], int(values[5])
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
        self._masks[key][index] = True  # on the device, from a host index: no sync
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

    def scalars(self) -> dict[str, float]:
        """``numguard/grad_norm`` and the z-scores of the latest host read, once (no device read).

        The caller hands them to :class:`~lightning_numguard.callbacks._series.RunSeries` with the counters.
        """
        if self.last is None:
            return {}
        _, values = self.last
        self.last = None
        metrics: dict[str, float] = {}
        if math.isfinite(values[1]) and values[1] > NOT_JUDGED:
            metrics["numguard/grad_norm"] = float(values[1])
        for i, tag in ((2, "numguard/loss_zscore"), (3, "numguard/grad_norm_zscore")):
            if values[i] > NOT_JUDGED:
                metrics[tag] = float(values[i])
        return metrics

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
