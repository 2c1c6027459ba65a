"""The named slots of the one flag vector a step reads, their packing and the rank they carry.

Each step folds everything it checked into a handful of 0-d device values, packs them into one
float32 vector, all-reduces it with ``MAX`` across ranks and reads it on the host once. A slot is
"seen" when its value is positive. Before the reduce each rank multiplies the vector by
``world - rank``, so the reduced value says the *lowest* rank that saw the slot
(:func:`encode_rank` / :func:`decode`).

Slots in causal order of the step are :data:`SLOTS`. ``NORMS`` covers parameters, buffers,
optimizer state and gradients at once: which of them is non-finite is confirmed only after a hit.

Example:
    >>> import torch
    >>> zero = torch.zeros(())
    >>> packed = pack(input_max=torch.tensor(float("nan")), norm_total=zero, output_total=zero,
    ...               loss_total=zero, suspicious=zero, op=zero, quarantine=zero)
    >>> flags = decode(encode_rank(packed, rank=1, world=2).tolist(), world=2)
    >>> flags.seen(INPUT), flags.rank(INPUT), flags.seen(LOSS)
    (True, 1, False)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CLEAN",
    "INPUT",
    "LOCAL_SLOTS",
    "LOSS",
    "NORMS",
    "OP",
    "OUTPUT",
    "QUARANTINE",
    "SLOTS",
    "SUSPICIOUS",
    "StepFlags",
    "decode",
    "decode_raw",
    "encode_rank",
    "extras_at",
    "pack",
    "pack_slots",
    "stack_raw",
]

#: Slot names, in the order of the packed vector.
SLOTS: tuple[str, ...] = ("input", "norms", "output", "loss", "suspicious", "op", "quarantine")
INPUT, NORMS, OUTPUT, LOSS, SUSPICIOUS, OP, QUARANTINE = range(len(SLOTS))
#: Slots whose value is local to the rank that computed it (before DDP averages the gradients).
LOCAL_SLOTS: tuple[int, ...] = (INPUT, SUSPICIOUS, OUTPUT, OP, LOSS)


_TOTALS_MASK: dict[tuple[torch.device, int], torch.Tensor] = {}
_RANK_SCALE: dict[tuple[torch.device, int, int, int, int], torch.Tensor] = {}
#: dtypes one ``torch.stack`` with a float32 first value turns into a float32 vector as they are (type promotion:
#: ``True`` is ``1.0``, an integer index its float value)
_STACKED = frozenset({torch.float32, torch.bool, torch.int64})


def extras_at(checks: int = 0) -> int:
    """Where the raw values that ride after the flags (the spike statistics' extras) start in a packed or stacked
    vector: the one place that says how many values come before them (the :data:`SLOTS`, then one value per check
    passed as ``extra_checks``: ``checks``)."""
    return len(SLOTS) + checks


def _totals_mask(device: torch.device, length: int) -> torch.Tensor:
    """``[True] * 4 + [False] * (length - 4)`` on ``device``: which values of a packed vector are totals (the first
    four slots of :data:`SLOTS`; the rest are flags or raw extras), made once per device and length."""
    mask = _TOTALS_MASK.get((device, length))
    if mask is None:
        mask = _TOTALS_MASK[(device, length)] = torch.tensor([i <= LOSS for i in range(length)], device=device)
    return mask


def pack(
    *,
    input_max: torch.Tensor,
    norm_total: torch.Tensor,
    output_total: torch.Tensor,
    loss_total: torch.Tensor,
    suspicious: torch.Tensor,
    op: torch.Tensor,
    quarantine: torch.Tensor,
) -> torch.Tensor:
    """One float32 vector of :data:`SLOTS`: 1.0 where the slot was seen; no sync.

    The first four are *totals* (a NaN or Inf anywhere propagates into a max or sum, so the slot is
    seen when the total is non-finite); the last three are already 0/1 flags.
    """
    return pack_slots((input_max, norm_total, output_total, loss_total, suspicious, op, quarantine))


def pack_slots(values: Sequence[torch.Tensor], extras: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """:func:`pack` of the 0-d slot values in :data:`SLOTS` order (as :func:`stack_raw` takes them), followed by the
    0-d ``extras`` as they are (from :func:`extras_at` on), in the same ``stack``; no sync."""
    values = (*values, *extras)
    device = values[0].device
    if values[0].dtype == torch.float32 and all(v.dtype in _STACKED and v.device == device for v in values):
        raw = torch.stack(values)  # the usual step, four ops: float32 (a bool flag is promoted to 0.0/1.0)
        return torch.where(_totals_mask(device, len(values)), raw.isfinite().logical_not_(), raw)
    n = len(values) - len(extras)
    totals = torch.stack(values[: LOSS + 1]).to(torch.float32)
    flags = torch.stack(values[LOSS + 1 : n]).to(device=totals.device, dtype=torch.float32)
    parts = [(~torch.isfinite(totals)).to(torch.float32), flags]
    if extras:
        parts.append(torch.stack([v.to(totals.device, torch.float32) for v in extras]))
    return torch.cat(parts)


def stack_raw(values: Sequence[torch.Tensor], extras: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """The 0-d slot values of :func:`pack`'s arguments (in :data:`SLOTS` order) as they are, in one float32 vector,
    followed by the 0-d ``extras`` (from :func:`extras_at` on).

    One process needs no reduce, so the host can judge the raw values itself (:func:`decode_raw`): one
    ``stack`` instead of :func:`pack`'s eight ops. No sync.
    """
    # one stack whatever the dtypes (bool flags and narrower floats are promoted as the stack goes), and a float32
    # cast only where a value was wider (float64: beyond float32's range it is ``inf``, as each value's own cast)
    raw = torch.stack([*values, *extras])
    return raw if raw.dtype == torch.float32 else raw.float()


def decode_raw(values: Sequence[float], suspicious_at: float | None = None) -> StepFlags:
    """The :class:`StepFlags` of one process's host-read :func:`stack_raw` vector (rank 0 saw what it saw).

    ``suspicious_at``: the ``SUSPICIOUS`` slot holds the largest unmasked input value, seen when it is at least this
    (``NumGuardCallback(max_abs_input=...)``; NaN never is); ``None``: it holds a 0/1 flag like the others.
    """
    if len(values) != len(SLOTS):
        raise ValueError(f"expected {len(SLOTS)} slot values ({', '.join(SLOTS)}), got {len(values)}")
    # the usual step: the four totals finite (a float64 sum of float32 values cannot overflow) and no flag positive
    if math.isfinite(values[INPUT] + values[NORMS] + values[OUTPUT] + values[LOSS]):
        if suspicious_at is None:
            if max(values[SUSPICIOUS:]) <= 0:
                return CLEAN
        elif max(values[OP:]) <= 0 and not values[SUSPICIOUS] >= suspicious_at:
            return CLEAN
    n_totals = LOSS + 1  # input, norms, output, loss: seen when non-finite; the rest: seen when positive
    isfinite = math.isfinite
    ranks = [-1 if isfinite(v) else 0 for v in values[:n_totals]] + [0 if v > 0 else -1 for v in values[n_totals:]]
    if suspicious_at is not None:  # NaN never is
        ranks[SUSPICIOUS] = 0 if values[SUSPICIOUS] >= suspicious_at else -1
    return StepFlags(tuple(ranks))


def encode_rank(packed: torch.Tensor, rank: int, world: int, width: int | None = None) -> torch.Tensor:
    """``packed`` scaled so that a ``MAX`` reduce keeps the lowest rank that saw each slot.

    ``width``: only the first ``width`` values are flags (the raw extras after them, :func:`extras_at`, stay as they
    are: one multiply by a per-value scale made once per device, rank and layout); ``None``: all of them.
    """
    if world <= 1:
        return packed
    if width is None or width >= packed.numel():
        return packed * float(world - rank)
    key = (packed.device, rank, world, width, packed.numel())
    scale = _RANK_SCALE.get(key)
    if scale is None:
        ones = [1.0] * (packed.numel() - width)
        scale = _RANK_SCALE[key] = torch.tensor([float(world - rank)] * width + ones, device=packed.device)
    return packed * scale


@dataclass(frozen=True)
class StepFlags:
    """The decoded flag vector: for each slot, the lowest rank that saw it, or ``-1``."""

    ranks: tuple[int, ...]

    def seen(self, slot: int) -> bool:
        """Whether any rank saw ``slot``."""
        return self.ranks[slot] >= 0

    def rank(self, slot: int) -> int:
        """The lowest rank that saw ``slot`` (``-1`` when none did)."""
        return self.ranks[slot]

    def seen_on(self, slot: int, rank: int, world: int) -> bool:
        """Whether ``rank`` should look at its local records of ``slot``.

        With one rank, exactly when it saw the slot; with several, whenever any rank did (the lowest
        rank is encoded, so every rank looks and the gather keeps what each one found).
        """
        return self.ranks[slot] == rank or (world > 1 and self.ranks[slot] >= 0)

    @property
    def any(self) -> bool:
        """Whether any slot was seen."""
        return max(self.ranks) >= 0

    def any_local(self) -> bool:
        """Whether a rank-local slot (inputs, outputs, ops, loss) was seen."""
        return any(self.ranks[s] >= 0 for s in LOCAL_SLOTS)


#: the flags of a step in which no slot was seen (one process's usual read: :func:`decode_raw`)
CLEAN = StepFlags((-1,) * len(SLOTS))


def decode(values: Sequence[float], world: int) -> StepFlags:
    """The :class:`StepFlags` of a reduced, host-read vector (the :data:`SLOTS`, then the 0/1 flags of the checks
    passed as ``extra_checks``, rank-encoded the same way)."""
    if len(values) < len(SLOTS):
        raise ValueError(f"expected {len(SLOTS)} flag values ({', '.join(SLOTS)}) or more, got {len(values)}")
    return StepFlags(tuple(round(world - v) if v > 0 else -1 for v in values))
