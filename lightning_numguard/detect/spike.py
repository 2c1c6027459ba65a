"""Spike statistics on the device: a rolling window of the loss and the global gradient norm, and overflow headroom.

A NaN is usually the end of a story that started earlier with a finite spike. This module keeps, as
device tensors updated with no host read, the last ``window`` steps of the loss and of the global gradient
norm, and scores each new value against them:

* **cube roots, robust, one-sided.** Values are judged as ``cbrt(x)`` (sign kept: a negative loss is fine);
  the *center* is their median over the window and the *scale* is how far their 95th percentile lies above the
  median, divided by 1.645 (a normal's 95th percentile: the scale is a standard deviation when the roots are
  normal), at least a floor of ``|center|`` (:data:`SCALE_FLOORS`: 10 % for the loss, 25 % for the gradient norm;
  and 1e-3). A value spikes when ``cbrt(x) > center + sigma * scale``. Only upward moves count.
* **Why cube roots.** Per-batch losses of small batches are heavy-tailed: a mean of 4 squared errors is a scaled
  chi-square with 4 degrees of freedom, whose linear z-scores reach 6 to 9 within a few hundred clean steps
  (measured), so a mean ± sigma·std rule (OLMo-core's ``SkipStepOptimizer``) or a median ± MAD rule in
  linear space skips the data's own tail. The cube root makes a chi-square nearly normal (Wilson and
  Hilferty, 1931), and the threshold scales with the batch noise on its own. Logarithms would over-correct.
* **Why the tail and the floors, not the MAD (issue 33).** The rule before scaled by the upper-half MAD (the median
  distance above the median, over 0.6745), at least 5 % of ``|center|`` for both series, and skipped clean steps of
  small-batch runs (a tiny GPT-2 at a batch of 2 at step 85, z 11.0 against sigma 10). The MAD measures the body of
  the window and extrapolates to its tail as if the roots were normal; small batches are not. Two shapes broke it
  (``benchmarks/spike_table.py``, 4,000 steps each). A loss near zero (a CNN that has learned its task, a memorising
  Transformer) has a tight body and a tail of batches 3 to 1,000x its median: the MAD misses the tail, the 95th
  percentile holds it. A small batch's global gradient norm is its hardest sample's gradient, while its loss is a
  mean with the easy ones: GPT-2's gradient norm is tight up to its 95th percentile and still jumps 5x, and up to
  23x, its median on one clean batch of median loss every few hundred steps. No quantile of a clean window
  foresees that, so the floor is the prior, and the gradient norm's is the larger: any spike is at least
  ``(1 + sigma * floor) ** 3`` times the median, 8x for the loss and 43x for the gradient norm at sigma 10 (3.4x for
  both before). The drift that a young window (16 values at arming) or a warm-up or cosine schedule brings within the
  32 steps between refreshes is covered by both. A loss or a gradient 1000x is still caught at its own step.
* **NaN-safe.** A non-finite value, the missing mark :data:`NOT_JUDGED` and any value at or beyond 1e30 in magnitude
  enter the window as "missing" (sorted last, as ``+inf``, and not counted) and are never a spike: a NaN step never
  poisons the history, and non-finite values stay the business of the NaN guard. No ``0 * x`` masking anywhere.
* **Warm-up.** Fewer than ``warmup`` valid values in the window: nothing is judged.
* **Cheap on the device.** The window keeps raw values; its statistics (the centers and the raw thresholds
  ``(center + sigma * scale) ** 3``) are recomputed every ``refresh_every`` steps (one ``sort`` of the window and
  one ``gather`` of the two quantiles: 22 ops) and ride in the step's one read with the raw values, and the host
  scores the step (:func:`judge`): a step costs the device one ``stack`` and one ``cat``. The default sigma is 10
  (see ``docs/reference.md``, "Spikes", and ``benchmarks/spike_table.py``).

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

from lightning_numguard._compat import flat_norm_f32, foreach_norm_f32

__all__ = [
    "DTYPE_MAX",
    "EXTRAS",
    "NOT_JUDGED",
    "SCALE_FLOORS",
    "SERIES",
    "SpikeWindow",
    "device_spike",
    "escalate",
    "global_norm",
    "headroom",
    "judge",
    "scores",
    "spike_z",
    "tensor_norms",
    "zscore",
]

#: The smallest scale of each series (:data:`SERIES`), relative to ``|center|`` (in cube-root units): a positive
#: spike is at least ``(1 + sigma * floor) ** 3`` times the median however tight the window: the loss 8x at the
#: default sigma 10 (4.1x at sigma 6), the gradient norm 43x (15.6x at sigma 6). No quantile of a tight window
#: foresees a clean jump, so the floor is the prior. The gradient norm's is larger because a small batch's gradient
#: is its hardest sample's while its loss is a mean with the easy ones: GPT-2 at a batch of 2
#: (``benchmarks/spike_table.py``) jumps 22.7x its median gradient norm on a batch of median loss, in a window whose
#: 95th percentile is 2x, and 5.2x in one whose 95th percentile is 1.18x; no clean loss jumped more than 11x (with a
#: window that holds the tail, 95th percentile 5x). A loss or gradient 1000x is still past either: z 36 and more.
SCALE_FLOORS: tuple[float, float] = (0.1, 0.25)
#: The smallest scale in absolute cube-root units (a window of zeros).
_SCALE_MIN = 1e-3
#: The quantiles of the window picked from its one sort: the median (the center) and the tail quantile whose
#: distance above the median, over a normal's (:data:`_TAIL_NORMAL`), is the scale.
QUANTILES = (0.5, 0.95)
#: A normal distribution's 95th percentile, in standard deviations above its median.
_TAIL_NORMAL = 1.6448536269514722
#: A raw value at or beyond this magnitude (and any non-finite value, and the mark :data:`NOT_JUDGED`) is missing
#: from the window's statistics; the step's own value is still judged on the host.
_MISSING_AT = 1.0e30
#: the smallest magnitude float32 rounds to infinity (its largest finite value and half a unit in the last place)
_F32_OVERFLOW = float(torch.finfo(torch.float32).max) + 2.0**103
#: The z-score of a value that is not judged (warm-up, or not finite), and the raw value that stands for a
#: missing one. Finite, so that it survives a ``MAX`` all-reduce.
NOT_JUDGED = -1.0e30
#: The raw values that follow the flag slots in the step's one packed vector, in order. ``loss`` is this
#: rank's loss (``MAX`` over ranks after the reduce), ``grad_norm`` the global L2 norm of the gradients (the
#: same on every rank), ``*_center`` and ``*_threshold`` the window's statistics (the same on every rank: the window
#: holds reduced values), from which the host scores the step (:func:`judge`); ``overflow_ratio`` the largest
#: peak/limit ratio of a block not reported yet, ``overflow_block`` its index (``-1`` when below the headroom);
#: ``loss_rank`` and ``overflow_rank`` are ``world - rank`` on a rank whose loss spiked or whose block is at risk,
#: else 0 (``MAX``: the lowest such rank).
EXTRAS: tuple[str, ...] = (
    "loss",
    "grad_norm",
    "loss_center",
    "grad_norm_center",
    "loss_threshold",
    "grad_norm_threshold",
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


_NAN_INF: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_PICKS: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _nan_inf(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d float32 ``NaN`` and ``+inf`` on ``device``, made once (a ``where`` with a Python scalar makes one each
    call)."""
    const = _NAN_INF.get(device)
    if const is None:
        both = torch.tensor([math.nan, math.inf], device=device)
        const = _NAN_INF[device] = (both[0], both[1])
    return const


def _picks(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:data:`QUANTILES`, ``1e-3 - QUANTILES`` and :data:`SCALE_FLOORS` on ``device``, made once: the sorted positions
    of the quantiles of ``n`` values are ``floor(q * (n - 1) + 1e-3)`` (one ``addcmul``; the 1e-3 keeps ``0.95 * 20``
    at 19 in float32)."""
    const = _PICKS.get(device)
    if const is None:
        q = torch.tensor(QUANTILES, device=device)
        const = _PICKS[device] = (q, 1e-3 - q, torch.tensor(SCALE_FLOORS, device=device))
    return const


def _kept(values: torch.Tensor) -> torch.Tensor:
    """Where raw values count: finite, below :data:`_MISSING_AT` in magnitude, and not the mark :data:`NOT_JUDGED`
    (``NaN`` and ``inf`` compare false; the mark is ``-_MISSING_AT``). Two ops."""
    return values.abs() < _MISSING_AT


def _stats(window: torch.Tensor, warmup: int, sigma: float, rows: slice = slice(None)) -> torch.Tensor:
    """``[center x rows, threshold x rows]`` of raw ``[rows, n]`` values (the rows of :data:`SERIES` that ``rows``
    picks: both by default); no sync.

    One sort of each row (missing values last, as ``+inf``) gives its median and its 95th percentile of the valid
    values; the cube root is monotone, so those of the raw values are those of the roots, and only the two picked
    values are rooted. The center is the median's root (``0`` when none is valid); the scale the 95th percentile's
    root above it over a normal's 1.645, at least the series' :data:`SCALE_FLOORS` of ``|center|``; the threshold the
    raw value a new one must exceed to spike: ``(center + sigma * scale) ** 3``, ``+inf`` where a row holds fewer
    than ``warmup`` valid values (nothing is judged). 22 ops.
    """
    inf = _nan_inf(window.device)[1]
    q, offset, floors = _picks(window.device)
    kept = _kept(window)
    ordered = torch.where(kept, window, inf).sort(dim=-1).values
    n = kept.sum(dim=-1, dtype=torch.float32)
    at = torch.addcmul(offset, n.unsqueeze(-1), q).long()  # [rows, 2]; n = 0 gives 0 (truncated towards zero)
    # the aten op itself: the op guard intercepts Python's ``gather`` in a step, and these indices need no judging
    picked = torch.ops.aten.gather.default(ordered, -1, at)
    size = picked.abs().pow(1.0 / 3.0)
    roots = size.copysign(picked)
    center = roots[..., 0]
    spread = (roots[..., 1] - center) / _TAIL_NORMAL
    scale = torch.maximum(spread, size[..., 0] * floors[rows]).clamp_min(_SCALE_MIN)
    judges = n >= warmup
    threshold = torch.where(judges, torch.add(center, scale, alpha=sigma).pow(3), inf)
    return torch.cat([center.nan_to_num(0.0, posinf=0.0), threshold])


def _f32_range(value: float) -> float:
    """``value`` as float32 rounds it at the ends of its range: ``±inf`` beyond them (NaN stays NaN), so that numpy's
    cast into a float32 window does not warn."""
    return math.copysign(math.inf, value) if abs(value) >= _F32_OVERFLOW else value


def zscore(value: float, center: float, threshold: float, sigma: float) -> float | None:
    """A host value's score against host statistics (:func:`_stats`): ``(cbrt(value) - center) / scale``, with
    ``scale = (cbrt(threshold) - center) / sigma``; ``None`` when not judged (warm-up, or ``value`` not finite)."""
    if not (math.isfinite(value) and value > NOT_JUDGED and math.isfinite(threshold) and math.isfinite(center)):
        return None
    root = math.copysign(abs(value) ** (1.0 / 3.0), value)
    top = math.copysign(abs(threshold) ** (1.0 / 3.0), threshold)
    scale = (top - center) / sigma
    return (root - center) / scale if scale > 0 else None


class SpikeWindow:
    """The rolling window of the loss and the global gradient norm, on the device.

    ``values`` is a ``[window, 2]`` float32 tensor of raw values (column 0: loss, column 1: gradient norm; ``NaN``,
    ``Inf`` and the mark :data:`NOT_JUDGED` count as missing; :meth:`state_dict` shows it as ``[2, window]``); each
    step writes its row at ``pos`` (a host integer: no index is read back) and moves on, so the window always spans
    the last ``window`` steps. A step costs its row write; the statistics (:meth:`stats`: the centers and the raw
    thresholds) are recomputed every ``refresh_every`` pushes, and at the push that completes the warm-up, so that
    judging starts on time.

    Args:
        window: steps kept.
        warmup: valid values a row needs before its new values are judged.
        refresh_every: pushes between recomputations of the statistics (a value is then judged against the window
            as it was at most ``refresh_every`` steps earlier). 1: every step, exact.
        sigma: robust standard deviations above the center that make a spike (in the thresholds).

    Example:
        >>> w = SpikeWindow(window=8, warmup=4)
        >>> for x in [1.0, 1.1, 0.9, 1.0, 1.05]:
        ...     w.push(torch.tensor([x, x]))
        >>> z = w.scores(torch.tensor([100.0, 1.0]))
        >>> bool(z[0] > 6), bool(z[1] > 6)
        (True, False)
    """

    def __init__(self, window: int = 128, warmup: int = 16, refresh_every: int = 1, sigma: float = 6.0) -> None:
        if window < 1 or not 1 <= warmup <= window or refresh_every < 1:
            raise ValueError(
                f"need window >= 1, 1 <= warmup <= window and refresh_every >= 1, got window={window}, "
                f"warmup={warmup}, refresh_every={refresh_every}"
            )
        self.window = window
        self.warmup = warmup
        self.refresh_every = refresh_every
        self.sigma = sigma
        self.values = torch.full((window, 2), math.nan)
        self.pos = 0
        self.count = 0  # pushes, at most ``window``: the steps the window spans (host)
        self._stats: torch.Tensor | None = None
        self._age = 0  # pushes since the statistics were computed
        self._armed = False  # the statistics were computed with the warm-up complete
        self._host: tuple[torch.Tensor, Any] | None = None  # a CPU window and a float32 view of its memory (push_host)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_host": None}  # a view of memory is made again at the next push

    def to(self, device: torch.device) -> SpikeWindow:
        """Keep the window on ``device`` (once per fit; a no-op when it is there)."""
        if self.values.device != device:
            self.values = self.values.to(device)
            self._stats = None
        return self

    def stats(self) -> torch.Tensor:
        """``[center_loss, center_grad_norm, threshold_loss, threshold_grad_norm]`` of the window before this step
        (refreshed when due); no sync."""
        due = self._age >= self.refresh_every or (not self._armed and self.count >= self.warmup)
        if self._stats is None or due:
            self._stats, self._age = _stats(self.values.T, self.warmup, self.sigma), 0
            self._armed = self.count >= self.warmup
        return self._stats

    def write(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Write this step's raw values (0-d float32) into the row the next push takes, in one ``stack``, and return
        that row (a view); :meth:`push` with nothing then moves on. No sync."""
        row = self.values[self.pos]
        torch.stack([loss, grad_norm], out=row)
        return row

    def scores(self, values: torch.Tensor) -> torch.Tensor:
        """The z-scores of this step's raw ``[loss, grad_norm]`` against the window before it (:data:`NOT_JUDGED` for
        a row in warm-up and for a value that is not finite). **Syncs**: for tests and tables; a fit reads the raw
        values and :meth:`stats` in its one packed read and scores them on the host (:func:`judge`)."""
        extras = torch.cat([values.to(self.values.device, torch.float32), self.stats()]).tolist()
        z = [zscore(extras[i], extras[2 + i], extras[4 + i], self.sigma) for i in range(2)]
        return torch.tensor([NOT_JUDGED if v is None else v for v in z])

    def push(self, values: torch.Tensor | None = None) -> None:
        """Add this step's raw ``[loss, grad_norm]`` (``None``: already written in :meth:`column`); no sync."""
        if values is not None:
            self.values[self.pos] = values
        self.pos = (self.pos + 1) % self.window
        self.count = min(self.count + 1, self.window)
        self._age += 1

    def push_host(self, loss: float, grad_norm: float) -> None:
        """:meth:`push` of host numbers (one process's read): on the CPU written through a view of the window's own
        memory, made once per window tensor (no op); elsewhere one copy of a host row. Rounded to float32 as
        ``torch.tensor`` rounds them (beyond its range: ``inf``). No sync."""
        values, host = self.values, self._host
        if host is None or host[0] is not values:  # a new window tensor (load_state_dict, to): a new view
            if values.device.type != "cpu":
                self.push(torch.tensor((loss, grad_norm), dtype=torch.float32).to(values.device, non_blocking=True))
                return
            if not values.is_contiguous():
                self.values = values = values.contiguous()
            host = self._host = (values, values.numpy().data.cast("B").cast("f"))  # float32, row after row
        view, row = host[1], 2 * self.pos
        view[row] = loss if not abs(loss) >= _F32_OVERFLOW else math.copysign(math.inf, loss)  # as _f32_range
        view[row + 1] = grad_norm if not abs(grad_norm) >= _F32_OVERFLOW else math.copysign(math.inf, grad_norm)
        self.pos = (self.pos + 1) % self.window  # push(), inline
        self.count = min(self.count + 1, self.window)
        self._age += 1

    def valid(self) -> list[int]:
        """Valid values per row. **Syncs** (reports and tests only)."""
        return [int(n) for n in _kept(self.values.T).sum(dim=-1).tolist()]

    def state_dict(self) -> dict[str, Any]:
        """The window as tensors (for snapshots: cloned, restored in place)."""
        return {"values": self.values.T, "pos": self.pos, "count": self.count}

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
        count = int(state.get("count", values.shape[1]))
        if values.shape[1] != self.window:  # oldest first, then keep the newest `window` of them
            ordered = torch.cat([values[:, pos:], values[:, :pos]], dim=1)[:, -self.window :]
            values = torch.full((2, self.window), math.nan)
            values[:, : ordered.shape[1]] = ordered.cpu()
            pos = ordered.shape[1] % self.window
        self.values = values.T.contiguous().to(self.values.device, copy=True)
        self.pos = pos
        self.count = min(count, self.window)
        self._stats = None
        self._armed = False

    def to_plain(self) -> dict[str, Any]:
        """The window as plain Python numbers, ``None`` for a missing value (the callback's checkpoint state).
        **Syncs.**"""
        rows = [[None if not math.isfinite(v) else v for v in row] for row in self.values.T.cpu().tolist()]
        return {"values": rows, "pos": self.pos, "window": self.window, "count": self.count}


def spike_z(value: float, history: Sequence[float], warmup: int, series: str = "loss") -> float | None:
    """The rule of :class:`SpikeWindow` on host numbers: ``value``'s z-score against ``history`` of ``series`` (one of
    :data:`SERIES`: its scale floor), or ``None`` when it is not judged (fewer than ``warmup`` finite values, or
    ``value`` not finite). The score does not depend on sigma.
    """
    window = torch.tensor([list(history) or [math.nan]], dtype=torch.float32)
    row = SERIES.index(series)
    center, threshold = _stats(window, warmup, 6.0, slice(row, row + 1)).tolist()
    return zscore(float(value), center, threshold, 6.0)


def judge(
    extras: Sequence[float], sigma: float, scored: Sequence[float | None] | None = None
) -> list[tuple[str, float, float]]:
    """``(series, value, z)`` of each series of a host-read extras vector (:data:`EXTRAS`) whose score exceeds
    ``sigma``: the guard's decision, the same in a fit and in the benchmark tables. ``scored``: their
    :func:`scores`, when the caller has them already."""
    out = []
    for i, (name, z) in enumerate(zip(SERIES, scores(extras, sigma) if scored is None else scored)):
        if z is not None and z > sigma:
            out.append((name, float(extras[i]), z))
    return out


def scores(extras: Sequence[float], sigma: float) -> list[float | None]:
    """The z-scores of both series of a host-read extras vector (``None``: not judged)."""
    return [zscore(float(extras[i]), float(extras[2 + i]), float(extras[4 + i]), sigma) for i in range(2)]


def device_spike(extras: torch.Tensor) -> torch.Tensor:
    """0-d bool on the device: whether a reduced extras vector holds a spike (the deferred mode's skip): a raw value
    above its threshold."""
    return (extras[0:2] > extras[4:6]).any()


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
        0-d float32 ratio (0 when nothing is watched) and 0-d index into the buffers laid end to end (``-1`` when
        the ratio is below ``1 / factor``). Non-finite rows are the NaN guard's, not counted. About seven ops for one
        buffer: the rows' inf-norm, the division, the reported and non-finite rows zeroed, ``max``, the headroom test.
    """
    ratios = []
    for (dtype, rows), done in zip(buffers, reported):
        peak = torch.linalg.vector_norm(rows, math.inf, dim=-1, dtype=torch.float32)  # max |x| per row, one kernel
        ratio = (peak / DTYPE_MAX.get(dtype, math.inf)).masked_fill_(done, 0.0)
        ratios.append(ratio.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0))  # a non-finite row is the NaN guard's
    if not ratios:
        zero = torch.zeros(())
        return zero, zero - 1
    every = ratios[0] if len(ratios) == 1 else torch.cat(ratios)
    best, index = every.max(dim=0)
    return best, index.masked_fill_(best < 1.0 / factor, -1)


def tensor_norms(groups: list[list[torch.Tensor]], device: torch.device, flat: Sequence[bool]) -> list[torch.Tensor]:
    """L2 norms, 0-d float32 on ``device``, whose L2 norm is the global norm of :func:`global_norm`'s ``groups``:
    each tensor's, in order, with one fused ``_foreach_norm`` per group; of a group marked in ``flat``
    (:attr:`~lightning_numguard.detect.checks.TotalPlan.flat`, one flag per group: small CPU tensors), one norm of
    the whole group laid end to end. No sync. One process's read takes their global norm on the host."""
    norms: list[torch.Tensor] = []
    for tensors, whole in zip(groups, flat):
        if tensors:
            parts = [flat_norm_f32(tensors)] if whole else foreach_norm_f32(list(tensors))
            norms.extend(parts if parts[0].device == device else [p.to(device, non_blocking=True) for p in parts])
    return norms


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
