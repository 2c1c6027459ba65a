"""Spike statistics on the device: a rolling window of the loss and the global gradient norm, and overflow headroom.

A NaN is usually the end of a story that started earlier with a finite spike. This module keeps, as
device tensors updated with no host read, the last ``window`` steps of the loss and of the global gradient
norm, and scores each new value against them:

* **cube roots, robust, one-sided.** Values are kept as ``cbrt(x)`` (sign kept: a negative loss is fine);
  the *center* is their median over the window and the *scale* is the median of the deviations *above* the
  median divided by 0.6745 (a normal's upper-half MAD), at least 5 % of ``|center|`` (and 1e-3). A value
  spikes when ``cbrt(x) > center + sigma * scale``. Only upward moves count.
* **Why.** Per-batch losses of small batches are heavy-tailed: a mean of 4 squared errors is a scaled
  chi-square with 4 degrees of freedom, whose linear z-scores reach 6 to 9 within a few hundred clean steps
  (measured), so a mean ± sigma·std rule (OLMo-core's ``SkipStepOptimizer``) or a median ± MAD rule in
  linear space skips the data's own tail. The cube root makes a chi-square nearly normal (Wilson and
  Hilferty, 1931): the clean run's largest score drops to about 3.5, and the threshold scales with the batch
  noise on its own (at sigma 6, for a chi-square loss: about 110x the median for 1 sample per batch, 16x
  for 4, 8x for 8, 3.4x for 32, 2x for 128), so a 100x outlier batch of 4 is still caught at once (about
  14 sigma). Logarithms would over-correct (67x for 4 samples, so a 100x batch sits at the threshold).
* **NaN-safe.** A non-finite value enters the window as "missing" (``NaN``, ignored by ``nanmedian``) and is
  never a spike: a NaN step never poisons the history, and non-finite values stay the business of the NaN
  guard. No ``0 * x`` masking anywhere.
* **Warm-up.** Fewer than ``warmup`` valid values in the window: nothing is judged.

:class:`SpikeWindow` is the device state; :func:`spike_z` is the same rule on host numbers, for tables.
Overflow headroom (:func:`headroom`) compares the largest finite |x| of each watched block's output, per
output dtype, with the dtype's largest finite value.

torch and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_numguard._compat import foreach_norm_f32

__all__ = [
    "DTYPE_MAX",
    "EXTRAS",
    "NOT_JUDGED",
    "SCALE_FLOOR",
    "SERIES",
    "SpikeWindow",
    "device_spike",
    "escalate",
    "global_norm",
    "headroom",
    "judge",
    "spike_z",
]

#: The smallest scale, relative to ``|center|`` (in cube-root units): at sigma 6 a positive spike is at least
#: ``1.3 ** 3`` = 2.2x the median, even when the window is (nearly) constant. Clean runs' gradient norms, whose
#: windows are tight, wander up to ~1.9x (the benchmark models at small batches; OLMo-core's rule scores those
#: 6.2 to 6.4 sigma).
SCALE_FLOOR = 0.05
#: The smallest scale in absolute cube-root units (a window of zeros).
_SCALE_MIN = 1e-3
#: A normal distribution's median absolute deviation, in standard deviations.
_MAD_NORMAL = 0.6744897501960817
#: The z-score of a value that is not judged (warm-up, or not finite), and the raw value that stands for a
#: missing one. Finite, so that it survives a ``MAX`` all-reduce.
NOT_JUDGED = -1.0e30
#: The raw values that follow the flag slots in the step's one packed vector, in order. ``loss`` is this
#: rank's loss (``MAX`` over ranks after the reduce), ``grad_norm`` the global L2 norm of the gradients (the
#: same on every rank), ``*_z`` their scores against the window (``MAX``: the score of the largest loss),
#: ``overflow_ratio`` the largest peak/limit ratio of a block not reported yet, ``overflow_block`` its index
#: (``-1`` when below the headroom); ``loss_rank`` and ``overflow_rank`` are ``world - rank`` on a rank whose loss
#: spiked or whose block is at risk, else 0 (``MAX``: the lowest such rank).
EXTRAS: tuple[str, ...] = (
    "loss",
    "grad_norm",
    "loss_z",
    "grad_norm_z",
    "overflow_ratio",
    "overflow_block",
    "loss_rank",
    "overflow_rank",
)
#: The largest finite value of each floating dtype whose output ranges are watched for headroom.
DTYPE_MAX: dict[torch.dtype, float] = {
    torch.float16: float(torch.finfo(torch.float16).max),
    torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
    torch.float32: float(torch.finfo(torch.float32).max),
}
#: What a series is called in events and loggers.
SERIES: tuple[str, str] = ("loss", "grad_norm")


def _roots(values: torch.Tensor, marked: bool = True) -> torch.Tensor:
    """``cbrt(x)`` (sign kept) where ``x`` is finite (and, if ``marked``, not the missing mark :data:`NOT_JUDGED`),
    else ``NaN`` (missing); no sync."""
    if marked:
        values = torch.where(values > NOT_JUDGED, values, math.nan)
    root = values.abs().pow_(1.0 / 3.0).copysign_(values)  # in place on the one new tensor: no further allocation
    return root.nan_to_num_(nan=math.nan, posinf=math.nan, neginf=math.nan)  # +-Inf: missing too


def _stats(window: torch.Tensor, warmup: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's center, and ``1 / scale`` where it judges (enough valid values) else ``NaN``; no sync."""
    center = window.nanmedian(dim=-1).values
    above = window - center.unsqueeze(-1)
    above = torch.where(above > 0, above, math.nan)
    floor = (center.abs() * SCALE_FLOOR).clamp_min(_SCALE_MIN)
    scale = torch.fmax(above.nanmedian(dim=-1).values / _MAD_NORMAL, floor)
    judges = window.isnan().logical_not().sum(dim=-1) >= warmup
    return center, torch.where(judges, scale.reciprocal(), math.nan)


def _z(stats: tuple[torch.Tensor, torch.Tensor], roots: torch.Tensor) -> torch.Tensor:
    """``roots`` scored against ``stats`` (:data:`NOT_JUDGED` where a row does not judge or a value is missing)."""
    center, inverse_scale = stats
    return ((roots - center) * inverse_scale).nan_to_num(nan=NOT_JUDGED)  # NaN: not judged, or missing


def _scores(window: torch.Tensor, roots: torch.Tensor, warmup: int) -> torch.Tensor:
    """Each row's new value (``roots``, already cube roots) scored against the row of ``window``; no sync."""
    return _z(_stats(window, warmup), roots)


class SpikeWindow:
    """The rolling window of the loss and the global gradient norm, on the device.

    ``values`` is a ``[2, window]`` float32 tensor of cube roots (row 0: loss, row 1: gradient norm) with
    ``NaN`` for missing entries; each step writes its column at ``pos`` (a host integer: no index is read
    back) and moves on, so the window always spans the last ``window`` steps.

    Args:
        window: steps kept.
        warmup: valid values a row needs before its new values are judged.
        refresh_every: the center, scale and warm-up state are recomputed after this many pushes (a spike is
            then judged against the window as it was at most ``refresh_every`` steps earlier); between
            refreshes a score costs a handful of element-wise ops. 1: every step, exact.

    Example:
        >>> w = SpikeWindow(window=8, warmup=4)
        >>> for x in [1.0, 1.1, 0.9, 1.0, 1.05]:
        ...     w.push(torch.tensor([x, x]))
        >>> z = w.scores(torch.tensor([100.0, 1.0]))
        >>> bool(z[0] > 6), bool(z[1] > 6)
        (True, False)
    """

    def __init__(self, window: int = 128, warmup: int = 64, refresh_every: int = 1) -> None:
        if window < 1 or not 1 <= warmup <= window or refresh_every < 1:
            raise ValueError(
                f"need window >= 1, 1 <= warmup <= window and refresh_every >= 1, got window={window}, "
                f"warmup={warmup}, refresh_every={refresh_every}"
            )
        self.window = window
        self.warmup = warmup
        self.refresh_every = refresh_every
        self.values = torch.full((2, window), math.nan)
        self.pos = 0
        self._stats: tuple[torch.Tensor, torch.Tensor] | None = None
        self._age = 0  # pushes since the statistics were computed

    def to(self, device: torch.device) -> SpikeWindow:
        """Keep the window on ``device`` (once per fit; a no-op when it is there)."""
        if self.values.device != device:
            self.values = self.values.to(device)
            self._stats = None
        return self

    def roots(self, values: torch.Tensor, marked: bool = True) -> torch.Tensor:
        """Raw ``[loss, grad_norm]`` as the window keeps them (cube roots, ``NaN`` when missing); no sync."""
        if values.device != self.values.device or values.dtype != torch.float32:
            values = values.to(self.values.device, torch.float32)
        return _roots(values, marked)

    def scores(self, values: torch.Tensor, roots: torch.Tensor | None = None) -> torch.Tensor:
        """The z-scores of this step's raw ``[loss, grad_norm]`` (or of their :meth:`roots`) against the window
        before it; no sync. :data:`NOT_JUDGED` for a row in warm-up and for a value that is not finite.
        """
        if self._stats is None or self._age >= self.refresh_every:
            self._stats, self._age = _stats(self.values, self.warmup), 0
        return _z(self._stats, self.roots(values) if roots is None else roots)

    def push(self, values: torch.Tensor | None = None, roots: torch.Tensor | None = None) -> None:
        """Add this step's raw ``[loss, grad_norm]`` (non-finite ones as missing), or their :meth:`roots`; no sync."""
        if roots is None:
            assert values is not None, "push needs the raw values or their roots"
            roots = self.roots(values)
        column = roots
        self.values[:, self.pos] = column
        self.pos = (self.pos + 1) % self.window
        self._age += 1

    def valid(self) -> list[int]:
        """Valid values per row. **Syncs** (reports and tests only)."""
        return [int(n) for n in (~torch.isnan(self.values)).sum(dim=-1).tolist()]

    def state_dict(self) -> dict[str, Any]:
        """The window as tensors (for snapshots: cloned, restored in place)."""
        return {"values": self.values, "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or its plain-list form); a window of another length is re-laid out."""
        raw = state["values"]
        if isinstance(raw, (list, tuple)):  # the plain form: None marks a missing value
            if not all(isinstance(row, (list, tuple)) for row in raw):
                raise ValueError(f"a spike window has shape [2, window], got a flat list of {len(raw)}")
            raw = [[math.nan if v is None else float(v) for v in row] for row in raw]
        values = torch.as_tensor(raw, dtype=torch.float32)
        if values.dim() != 2 or values.shape[0] != 2:
            raise ValueError(f"a spike window has shape [2, window], got {list(values.shape)}")
        pos = int(state.get("pos", 0)) % values.shape[1]
        if values.shape[1] != self.window:  # oldest first, then keep the newest `window` of them
            ordered = torch.cat([values[:, pos:], values[:, :pos]], dim=1)[:, -self.window :]
            values = torch.full((2, self.window), math.nan)
            values[:, : ordered.shape[1]] = ordered.cpu()
            pos = ordered.shape[1] % self.window
        self.values = values.to(self.values.device, copy=True)
        self.pos = pos
        self._stats = None

    def to_plain(self) -> dict[str, Any]:
        """The window as plain Python numbers, ``None`` for a missing value (the callback's checkpoint state).
        **Syncs.**"""
        rows = [[None if math.isnan(v) else v for v in row] for row in self.values.cpu().tolist()]
        return {"values": rows, "pos": self.pos, "window": self.window}


def spike_z(value: float, history: Sequence[float], warmup: int) -> float | None:
    """The rule of :class:`SpikeWindow` on host numbers: ``value``'s z-score against ``history``, or ``None``
    when it is not judged (fewer than ``warmup`` finite values, or ``value`` not finite).
    """
    window = _roots(torch.tensor([list(history) or [math.nan]], dtype=torch.float32))
    z = float(_scores(window, _roots(torch.tensor([float(value)])), warmup)[0])
    return None if z <= NOT_JUDGED else z


def judge(extras: Sequence[float], sigma: float) -> list[tuple[str, float, float]]:
    """``(series, value, z)`` of each series of a host-read extras vector whose score exceeds ``sigma``."""
    out = []
    for i, name in enumerate(SERIES):
        value, z = float(extras[i]), float(extras[2 + i])
        if math.isfinite(z) and z > sigma and math.isfinite(value):
            out.append((name, value, z))
    return out


def device_spike(extras: torch.Tensor, sigma: float) -> torch.Tensor:
    """0-d bool on the device: whether a reduced extras vector holds a spike (the deferred mode's skip)."""
    return (extras[2:4] > sigma).any()


def escalate(configured: str, spike_steps: Sequence[int], step: int, window: int, rollback_after: int) -> str:
    """What to do about a spike at ``step``: the configured ``"warn"`` / ``"skip"`` / ``"rollback"``, except that
    ``"skip"`` becomes ``"rollback"`` when this is the ``rollback_after``-th spike within the last ``window``
    steps (``spike_steps``: the earlier ones; ``rollback_after`` 0: never).

    Example:
        >>> escalate("skip", [90, 95], step=100, window=128, rollback_after=3)
        'rollback'
    """
    if configured != "skip" or rollback_after <= 0:
        return configured
    recent = sum(1 for s in spike_steps if step - window < s < step) + 1
    return "rollback" if recent >= rollback_after else "skip"


def headroom(
    buffers: Sequence[tuple[torch.dtype, torch.Tensor]], reported: Sequence[torch.Tensor], factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest ``peak / dtype max`` of a watched block not reported yet, and its index; no sync.

    Args:
        buffers: per output dtype, the watch's ``[blocks, 2]`` (min, max) rows of this step (zeros where a
            block did not run).
        reported: per buffer, a bool ``[blocks]`` mask of the blocks already reported.
        factor: the headroom: a block is at risk when its peak is at least ``dtype max / factor``.

    Returns:
        0-d float32 ratio (0 when nothing is watched) and 0-d float32 index into the buffers laid end to end
        (``-1`` when the ratio is below ``1 / factor``). Non-finite rows are the NaN guard's, not counted.
    """
    ratios = []
    for (dtype, rows), done in zip(buffers, reported):
        peak = rows.abs().amax(dim=-1).float()
        ratio = peak / DTYPE_MAX.get(dtype, math.inf)
        ratios.append(torch.where(torch.isfinite(peak) & ~done, ratio, torch.zeros_like(ratio)))
    if not ratios:
        zero = torch.zeros(())
        return zero, zero - 1
    every = ratios[0] if len(ratios) == 1 else torch.cat(ratios)
    best, index = every.max(dim=0)
    at_risk = best >= 1.0 / factor
    return best, torch.where(at_risk, index.float(), torch.full_like(best, -1.0))


def global_norm(groups: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """0-d float32 on ``device``: the L2 norm of every tensor in ``groups`` (each group of one device and dtype:
    one fused ``_foreach_norm``); no sync.

    Non-finite when a tensor is, or when a norm overflowed float32 (elements above ~1e19): then the NaN guard
    confirms which, exactly, after the read, as for any candidate of the ``NORMS`` slot.
    """
    norms = []
    for tensors in groups:
        if tensors:  # the group's L2 norm: the norm of its tensors' norms (two ops)
            total = torch.linalg.vector_norm(torch.stack(foreach_norm_f32(list(tensors))))
            norms.append(total if total.device == device else total.to(device, non_blocking=True))
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
