"""Fused, sync-free detectors of non-finite values.

The hot path asks one question per group of tensors — "is anything here non-finite?" — and
answers it on the device without reading anything back:

* :func:`norm_candidates` computes every tensor's L2 norm in float32 with one
  ``torch._foreach_norm`` call per (device, dtype) group. A finite norm proves every
  element finite; a non-finite norm means NaN/Inf *or* a sum of squares that overflowed
  (elements above ~1e19). Such candidates are confirmed exactly by
  :func:`confirm_nonfinite` — which syncs, but runs only after a hit.
* :func:`max_abs` gives the exact per-tensor max-|x| (NaN propagates) from
  ``torch.aminmax``, for the few, possibly huge, tensors of a batch.

Measured on the project's 2-core CPU for 1M fp32 values in 16 tensors (median of 200):
``_foreach_norm(ord=2)`` 0.18 ms, ``aminmax`` 0.12 ms, ``_foreach_norm(ord=inf)`` 1.5 ms,
per-tensor ``isfinite().all()`` 1.6 ms, and the AdamW step itself 1.8 ms.

Per-tensor detail (:func:`tensor_stats`) syncs and is meant for after a hit only.

A ``DTensor`` (FSDP2, tensor parallel) is checked through its local shard (:func:`.dtensor.local`): every
function here reads only what this rank holds, never gathering the whole tensor; the caller's all-reduce
of the flags makes the verdict global.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from lightning_numguard._compat import foreach_nonfinite_, foreach_norm_f32
from lightning_numguard.dtensor import has_dtensor, local

__all__ = [
    "InputEnds",
    "TotalPlan",
    "as_f32",
    "bad_positions",
    "confirm_nonfinite",
    "finfo_max",
    "input_ends",
    "input_maxima",
    "is_checkable",
    "max_abs",
    "max_abs_total",
    "norm_candidates",
    "norm_total",
    "tensor_stats",
    "unmasked_of",
    "unmasked_on_host",
]


def _checkable(t: torch.Tensor) -> torch.Tensor | None:
    """The strided floating view of ``t`` (its local shard, for a ``DTensor``) to check, or ``None`` for tensors
    never checked."""
    if type(t) is not torch.Tensor:
        t = local(t)
    if t.layout is not torch.strided:
        if t.is_sparse:
            t = t.coalesce().values()
        else:
            return None
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point() or t.numel() == 0:
        return None
    return t


_F32_MAX = torch.finfo(torch.float32).max


def as_f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 with finite values beyond float32's range clamped to its max (float64 ``1e100`` is
    finite and huge, not ``inf``); NaN and ±Inf stay as they are. No sync."""
    if x.dtype == torch.float32:
        return x
    if x.dtype == torch.float64:
        x = torch.where(torch.isfinite(x), x.clamp(-_F32_MAX, _F32_MAX), x)
    return x.float()


def norm_candidates(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Per-tensor float32 L2 norms, in input order, on ``device``; no host sync.

    A finite entry proves the tensor finite. A non-finite entry is a *candidate*: NaN/Inf,
    or finite values so large that their sum of squares overflowed; confirm it with
    :func:`confirm_nonfinite`. Tensors that are never checked (integer, empty, unsupported
    layouts) get ``0``.
    """
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        c = _checkable(t)
        if c is None:
            continue
        idx, ts = groups.setdefault((c.device, c.dtype), ([], []))
        idx.append(i)
        ts.append(c.detach())
    zero = torch.zeros((), dtype=torch.float32, device=device)
    slots: list[torch.Tensor] = [zero] * len(tensors)
    for (dev, _), (idx, ts) in groups.items():
        for i, norm in zip(idx, foreach_norm_f32(ts)):
            slots[i] = norm if dev == device else norm.to(device, non_blocking=True)
    # One stack of 0-d tensors in input order: no index tensor is copied from the host.
    return torch.stack(slots)


#: On the CPU a tensor of at least this many elements is checked by its own ``sum`` (one vectorised read,
#: about 3x cheaper than its norm); below it, the per-call overhead dominates and one fused call takes them all.
CPU_SUM_MIN_NUMEL = 1 << 15
#: On the CPU a group of small tensors of at most this many elements in all has its global norm taken of the group
#: laid end to end (one ``cat``, one norm: :func:`~lightning_numguard._compat.flat_norm_f32`), not as one norm
#: kernel per tensor; the copy costs less than the dispatches it saves.
CPU_FLAT_NORM_MAX_NUMEL = 1 << 20


def norm_total(tensors: Sequence[torch.Tensor], device: torch.device, *, rewritable: bool = False) -> torch.Tensor:
    """0-d float32 on ``device``, finite when every tensor is; no sync.

    A finite total proves every tensor finite; a non-finite one makes them candidates for
    :func:`confirm_nonfinite` (NaN/Inf, or finite values so large that a reduction overflowed). The
    hot-path form of :func:`norm_candidates` for tensors the caller knows to be strided, floating and
    non-empty (parameters, buffers, gradients), per (device, dtype) group:

    * on an accelerator, one ``_foreach_norm`` (a fused multi-tensor kernel) and its sum;
    * on the CPU, where ``_foreach_norm`` is a loop of norm kernels, each tensor of at least
      :data:`CPU_SUM_MIN_NUMEL` elements is summed (in float32, float64 for float64; a sum overflows
      only past ~3e38 in all, far later than a norm's squares at ~1e19), and the smaller ones take one
      fused call: with ``rewritable`` (tensors no other thread reads or writes meanwhile: gradients, and
      state while no snapshot copies it) the GradScaler's own non-finite check, which writes every element
      back unchanged; otherwise ``_foreach_norm``.

    Measured on the project's 2-core CPU, one thread (``benchmarks/results``): the 1.6M gradients of
    the MLP (8 tensors) 0.21 ms with ``_foreach_norm`` and 0.09 ms this way; the 1.6M gradients of the
    deep model (580 tensors) 0.87 ms and 0.35 ms.
    """
    return TotalPlan(tensors).total(tensors, device, rewritable=rewritable)


class TotalPlan:
    """:func:`norm_total` with the grouping done once, for tensors whose layout repeats every step.

    A step's gradients are new tensors, but each has its parameter's device, dtype and shape: a plan
    built from the parameters groups them (by device and dtype, large and small) once per fit, so a
    step pays no per-tensor Python work beyond indexing.

    Args:
        like: tensors with the devices, dtypes and sizes of those :meth:`total` will get, in order.
    """

    def __init__(self, like: Sequence[torch.Tensor]) -> None:
        self.local = has_dtensor(like)  # DTensors: every total reads their local shards
        if self.local:
            like = [local(t) for t in like]
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[int]]] = {}
        for i, t in enumerate(like):
            large, small = groups.setdefault((t.device, t.dtype), ([], []))
            (large if t.device.type == "cpu" and t.numel() >= CPU_SUM_MIN_NUMEL else small).append(i)
        self.groups = [(dev, dtype, large, small) for (dev, dtype), (large, small) in groups.items()]
        self.members = [large + small for _, _, large, small in self.groups]  # per group: every index, large first
        self.size = len(like)
        #: per group: whether its gradients' norm is taken laid end to end (a CPU group of small tensors only)
        self.flat = [
            dev.type == "cpu"
            and not large
            and len(small) > 1
            and sum(like[i].numel() for i in small) <= CPU_FLAT_NORM_MAX_NUMEL
            for dev, _, large, small in self.groups
        ]
        #: one CPU group of small tensors, in their own order (a small model): its gradients' norm is one norm of the
        #: step's list laid end to end, with no grouping
        self.whole_flat = (
            not self.local and len(self.groups) == 1 and self.flat[0] and self.members[0] == list(range(self.size))
        )
        # per group, what picks its tensors (all, the large ones, the small ones) out of a step's list, in C
        self._picks = [(_picker(large + small), _picker(large), _picker(small)) for _, _, large, small in self.groups]

    def grouped(self, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``tensors`` (laid out as this plan's ``like``) split into its groups (one device and dtype each), large
        tensors first: the groups :func:`~lightning_numguard.detect.spike.global_norm` takes; no per-step grouping,
        and no Python loop over the tensors (``operator.itemgetter``)."""
        return [_pick(every, tensors) for every, _, _ in self._picks]

    def total(self, tensors: Sequence[torch.Tensor], device: torch.device, *, rewritable: bool = False) -> torch.Tensor:
        """:func:`norm_total` of ``tensors`` (laid out as this plan's ``like``); no sync."""
        if self.local:
            tensors = [local(t) for t in tensors]
        sums = []
        for (dev, dtype, _, _), (_, large, small) in zip(self.groups, self._picks):
            if dev.type == "cpu":
                total = _cpu_total(_pick(large, tensors), _pick(small, tensors), dtype, rewritable)
            else:
                total = torch.stack(foreach_norm_f32(_pick(small, tensors))).sum()
            sums.append(total if dev == device else total.to(device, non_blocking=True))
        if not sums:
            return torch.zeros((), dtype=torch.float32, device=device)
        return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


#: what :func:`_pick` takes: no index, one index, or an ``itemgetter`` of several (each picklable)
_Picker = None | int | operator.itemgetter


def _picker(indices: list[int]) -> _Picker:
    """What picks ``[tensors[i] for i in indices]`` out of a list with :func:`_pick`, the loop in C."""
    if not indices:
        return None
    return indices[0] if len(indices) == 1 else operator.itemgetter(*indices)


def _pick(picker: _Picker, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if picker is None:
        return []
    if type(picker) is int:
        return [tensors[picker]]
    return list(picker(tensors))  # type: ignore[operator]


def _cpu_total(
    large: list[torch.Tensor], small: list[torch.Tensor], dtype: torch.dtype, rewritable: bool
) -> torch.Tensor:
    """One CPU group of :func:`norm_total`: float32, non-finite when a tensor is (or a sum overflowed)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    parts = [t.sum(dtype=acc) for t in large]
    if small:
        found = torch.zeros((), dtype=torch.float32) if rewritable else None
        if found is not None and foreach_nonfinite_(small, found):
            parts.append(found.neg().log1p().to(acc))  # 0 when clean, -inf when a value was not finite
        else:
            parts.append(torch.stack(foreach_norm_f32(small)).sum().to(acc))
    total = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
    return as_f32(total)


def is_checkable(t: torch.Tensor) -> bool:
    """Whether ``t`` (a ``DTensor``: its local shard) can go to :func:`norm_total` as it is (strided, floating,
    non-empty)."""
    t = local(t)
    return t.layout is torch.strided and t.is_floating_point() and t.numel() > 0


def max_abs(
    tensors: Sequence[torch.Tensor], device: torch.device | None = None, *, masks_as_zero: bool = False
) -> torch.Tensor:
    """Exact per-tensor max-|x| as a float32 vector on ``device`` (NaN propagates); no sync.

    Finite float64 values beyond float32's range give float32's max (finite), never ``inf``.
    ``masks_as_zero``: a tensor's minimum or maximum equal to its dtype's own finite extreme
    (``torch.finfo(dtype).min``/``max``, the conventional fill of an additive attention mask) counts as 0,
    as :func:`input_maxima` does.

    Uses ``torch.aminmax`` (one read of each tensor) rather than ``abs().amax()`` (which
    materialises a copy). Unchecked tensors (integer, empty) give 0.
    """
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    parts: list[torch.Tensor] = []
    for t in tensors:
        c = _checkable(t)
        if c is None:
            parts.append(torch.zeros(2, dtype=torch.float32, device=device))
            continue
        ends = torch.stack(torch.aminmax(c.detach()))
        if masks_as_zero:
            ends = ends.masked_fill(ends.abs() == torch.finfo(ends.dtype).max, 0)
        parts.append(as_f32(ends).to(device=device, non_blocking=True))
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.stack(parts).abs().amax(dim=1)


def _extremes(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``c``, NaN propagating, in one kernel (``aminmax``) on every device.

    On the CPU ``amin`` then ``amax`` is a few microseconds faster below ~1M values (two passes over data in cache),
    but it is two kernels: the step's op count (``benchmarks/op_count.py``) is the budget, not the CPU's microseconds.
    """
    return torch.aminmax(c)


def max_abs_total(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d float32 on ``device``: the largest |x| over all ``tensors`` (NaN propagates); no sync.

    The hot-path form of :func:`max_abs`: one ``aminmax`` per tensor and three ops in all. Finite float64
    values beyond float32's range give float32's max (finite), never ``inf``.
    """
    parts: list[torch.Tensor] = []
    for t in tensors:
        c = _checkable(t)
        if c is not None:
            parts.extend(_extremes(c.detach()))
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    if any(p.device != device or p.dtype != torch.float32 for p in parts):
        parts = [as_f32(p).to(device=device, non_blocking=True) for p in parts]
    return torch.stack(parts).abs().amax()


_FINFO_MAX: dict[torch.dtype, float] = {}


def finfo_max(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).max``, looked up once per dtype."""
    value = _FINFO_MAX.get(dtype)
    if value is None:
        value = _FINFO_MAX[dtype] = torch.finfo(dtype).max
    return value


def input_maxima(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 0-d float32 on ``device``: :func:`max_abs_total` of ``tensors``, and the same with each tensor's
    minimum or maximum that equals its dtype's own finite extreme counted as 0; no sync.

    ``torch.finfo(dtype).min`` is how an additive attention mask (the Hugging Face convention) says "never
    attend": a mask, not a fill value, so the second value, which the suspicious-input check reads, leaves
    it out. Numpy's ``1e20`` and netCDF's ``9.96921e36`` are no dtype's extreme and still count. Per tensor
    only its extremes are judged: a tensor holding both ``finfo.min`` and ``-1e20`` (and nothing above
    ``1e20``) counts as a mask. The step checks only the second (:func:`unmasked_input_max`).
    """
    ends = _input_ends(tensors, device)
    if not ends:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return zero, zero
    return _largest([e.amax() for e, _ in ends]), _largest([_unmasked(e, dtype) for e, dtype in ends])


def unmasked_input_max(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d float32 on ``device``: the second value of :func:`input_maxima` alone; no sync.

    Non-finite exactly when :func:`max_abs_total` is (a mask is a finite extreme), so the step's input check and
    its suspicious-input check both read it: :func:`unmasked_of` the :func:`input_ends`.
    """
    return unmasked_of(input_ends(tensors, device), device)


#: per dtype, the 0-d ``(min, max)`` of each checkable input tensor of that dtype (on the step's device)
InputEnds = list[tuple[torch.dtype, list[torch.Tensor]]]


def input_ends(tensors: Sequence[torch.Tensor], device: torch.device) -> InputEnds:
    """The :data:`InputEnds` of ``tensors``: one ``aminmax`` per checkable tensor and nothing else; no sync.

    The step keeps them and reduces them at its read: on the host, where one process reads them as they are
    (:func:`unmasked_on_host`), or on the device (:func:`unmasked_of`).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        c = _checkable(t)
        if c is not None:
            ends: Sequence[torch.Tensor] = _extremes(c.detach() if c.requires_grad else c)  # on the tensor's device
            if c.device != device:
                ends = [p.to(device=device, non_blocking=True) for p in ends]
            by_dtype.setdefault(c.dtype, []).extend(ends)
    return list(by_dtype.items())


def unmasked_of(ends: InputEnds, device: torch.device) -> torch.Tensor:
    """0-d float32 on ``device``: the largest ``|x|`` of the :data:`InputEnds` ``ends`` (several micro-batches' alike)
    with each dtype's own finite extreme counted as 0, NaN where one is non-finite; no sync.

    Four ops per dtype: a dtype's extreme is dropped with ``fmod(|x|, finfo.max)``, exact (``|x|`` below the extreme
    stays as it is, the extreme gives 0) and one kernel; a non-finite input gives NaN here (``inf`` too: the input
    check looks at it exactly).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype, parts in ends:
        by_dtype.setdefault(dtype, []).extend(parts)
    if not by_dtype:
        return torch.zeros((), dtype=torch.float32, device=device)
    return _largest([torch.fmod(torch.stack(p).abs(), finfo_max(d)).amax() for d, p in by_dtype.items()])


def unmasked_on_host(values: Sequence[float], modulus: float | None, finite: bool = False) -> float:
    """:func:`unmasked_of` on the host, of host-read float32 ends (``modulus``: their dtype's ``finfo.max``) or of
    values already unmasked on the device (``modulus=None``): NaN when one is not finite, else the largest.
    ``finite``: the caller knows them all finite."""
    if not values:
        return 0.0
    if not finite and not math.isfinite(sum(values)):  # a NaN or an inf (float32 values: a float64 sum is finite)
        return math.nan
    largest = max(map(abs, values))  # the usual: no value is the dtype's extreme (one C loop)
    if modulus is None or largest < modulus:
        return largest
    return max((a for a in map(abs, values) if a < modulus), default=0.0)


def _unmasked(ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ends.masked_fill(ends == finfo_max(dtype), 0).amax()


def _largest(values: list[torch.Tensor]) -> torch.Tensor:
    values = [as_f32(v) for v in values]
    return values[0] if len(values) == 1 else torch.stack(values).amax()


def _input_ends(tensors: Sequence[torch.Tensor], device: torch.device) -> list[tuple[torch.Tensor, torch.dtype]]:
    """Per dtype: the |min| and |max| of each checkable tensor, in one vector on ``device``, and the dtype."""
    return [(torch.stack(parts).abs(), dtype) for dtype, parts in input_ends(tensors, device)]


def confirm_nonfinite(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Exactly which tensors hold NaN or ±Inf. **Syncs** once; use only after a hit."""
    flags = []
    for t in tensors:
        c = _checkable(t)
        none = torch.zeros((), dtype=torch.bool, device=local(t).device)
        flags.append(none if c is None else ~torch.isfinite(c).all())
    if not flags:
        return []
    return [bool(x) for x in torch.stack([f.to(flags[0].device) for f in flags]).tolist()]


def tensor_stats(t: torch.Tensor, max_indices: int = 3) -> dict[str, object]:
    """Counts of NaN/+Inf/-Inf, the largest finite |x| and the first bad indices. **Syncs.**

    For a ``DTensor``: of this rank's local shard (``shape`` is then the shard's, ``global_shape`` the tensor's).
    """
    c = _checkable(t)
    if c is None:
        return {"numel": local(t).numel(), "nan": 0, "posinf": 0, "neginf": 0, "max_abs_finite": None}
    x = c.detach()
    nan = torch.isnan(x)
    posinf = torch.isposinf(x)
    neginf = torch.isneginf(x)
    finite = ~(nan | posinf | neginf)
    counts = torch.stack([nan.sum(), posinf.sum(), neginf.sum(), finite.sum()]).tolist()
    fin = x[finite]
    max_fin = float(fin.abs().max()) if fin.numel() else None
    bad = (~finite).nonzero()[:max_indices].tolist()
    stats: dict[str, object] = {
        "shape": list(local(t).shape),
        "dtype": str(t.dtype).replace("torch.", ""),
        "numel": x.numel(),
        "nan": int(counts[0]),
        "posinf": int(counts[1]),
        "neginf": int(counts[2]),
        "max_abs_finite": None if max_fin is None or math.isnan(max_fin) else max_fin,
        "first_bad_index": bad,
    }
    if local(t) is not t:
        stats["global_shape"] = list(t.shape)
    return stats


def bad_positions(t: torch.Tensor, at_least: float | None = None, limit: int = 3) -> dict[str, Any]:
    """Where a batch tensor's bad values are: the first ``limit`` element positions (``positions``, each a list of
    indices, ``batch['x'][3, 7]``), the first ``limit`` samples holding one (``samples``: indices along the first
    dimension) and how many samples do (``bad_samples``, of ``samples_in_batch``). **Syncs** (two reads; after a hit
    only).

    Bad: a NaN or an Inf; with ``at_least``, a finite value with ``|x| >= at_least`` that is not its dtype's own
    extreme (``torch.finfo(dtype).max``, the fill of an additive mask, as :func:`max_abs` with ``masks_as_zero``).
    Only the rows holding the first bad samples are searched for positions, so memory stays a row's. ``{}`` for a
    0-d, sparse, complex or non-floating tensor; for a ``DTensor``, the positions in this rank's local shard.
    """
    x = local(t)
    if x.layout is not torch.strided or x.is_complex() or not x.is_floating_point() or x.dim() == 0 or not x.numel():
        return {}
    x = x.detach()
    if at_least is None:
        bad = ~torch.isfinite(x)
    else:
        size = x.abs()
        bad = torch.isfinite(x) & (size >= at_least) & (size != torch.finfo(x.dtype).max)
    rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()
    found = rows[:limit]
    first, count = found.tolist(), int(rows.numel())  # one read: the rows, and their number (a 0-d on the host)
    if not first:
        return {}
    inner = bad[found].nonzero()[:limit].tolist()  # (row among ``found``, position in the row)
    positions = [[first[r], *rest] for r, *rest in inner]
    return {"positions": positions, "samples": first, "bad_samples": count, "samples_in_batch": int(x.shape[0])}
