"""The tail of one process's read: the per-tensor, per-call and per-record values it reads as they are.

One process's read (:meth:`StepRead._read_here <lightning_numguard.engine.read.StepRead>`) lays in its one ``stack``,
after the slots and the spike statistics, each input tensor's minimum and maximum, each watched call's max-|x|, each
guarded call's flag and the gradients' norms, where the read of several ranks (and the deferred read) reduces each
on the device first; :meth:`Tail.fold` reduces them into their slots on the host after the read.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_numguard.detect import checks, flags

__all__ = ["Tail"]

_F32 = torch.float32
_F32_MAX = torch.finfo(torch.float32).max


class Tail:
    """The 0-d values one process's read lays after the spike statistics' extras, in the same ``stack``, for the host
    to reduce into their slots: the inputs' ends, the watched outputs' max-|x|, the op guard's flags and the gradients'
    norms, which the read of several ranks (and the deferred read) reduces on the device first. A value per input
    tensor, watched call and guarded call costs the host a float to read, where a reduction on the device costs a
    kernel each."""

    __slots__ = ("grad_norm", "inputs", "norms", "op", "outputs", "parts", "values")

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        #: per part: its slot, how many values, and the ``finfo.max`` left out of them (inputs' ends), else ``None``
        self.parts: list[tuple[int, int, float | None]] = []
        self.inputs: list[tuple[int, int, float | None]] = []  # the inputs' parts: where, how many, the modulus
        self.norms: tuple[int, int] | None = None  # where the gradients' norms are in :attr:`values`, and how many
        self.outputs: tuple[int, int] = (0, 0)  # where the watched calls' max-|x| are in :attr:`values`, how many
        self.op: tuple[int, int] = (0, 0)  # where the op guard's flags are in :attr:`values`, how many
        #: after :meth:`fold`: the gradients' global L2 norm, when their norms were in the tail
        self.grad_norm: float | None = None

    def add_norms(self, norms: list[torch.Tensor]) -> None:
        """The gradients' per-tensor L2 norms (0-d float32): the ``NORMS`` slot's, and the global norm of them."""
        self.norms = (len(self.values), len(norms))
        if norms:
            self.parts.append((flags.NORMS, len(norms), None))
            self.values.extend(norms)

    def add_step(self, rec: Any, watch: Any, op_flags: list[torch.Tensor], device: torch.device) -> None:
        """The step record's inputs' ends, the watch's values and the op guard's flags."""
        for _, ends in rec.inputs:
            self.add_inputs(ends, device)
        values, parts = self.values, self.parts
        outputs = watch.values(device) if watch is not None else None
        if outputs:
            self.outputs = (len(values), len(outputs))
            parts.append((flags.OUTPUT, len(outputs), None))
            values.extend(outputs)
        if op_flags:
            self.op = (len(values), len(op_flags))
            parts.append((flags.OP, len(op_flags), None))
            values.extend([f.to(device) for f in op_flags])

    def add_inputs(self, ends: checks.InputEnds, device: torch.device) -> None:
        """One micro-batch's input ends: float32 ones as they are, another dtype's reduced on the device first (its
        values need not fit a float32 vector)."""
        for dtype, values in ends:
            if dtype is _F32:  # as they are
                modulus: float | None = _F32_MAX
            else:  # reduced on the device
                values, modulus = [checks.unmasked_of([(dtype, values)], device)], None
            if values:
                part = (len(self.values), len(values), modulus)
                self.inputs.append(part)
                self.parts.append((flags.INPUT, part[1], modulus))
                self.values.extend(values)

    def fold(self, values: list[float], at: int, suspicious: bool) -> None:
        """Reduce the host-read tail (from ``values[at]``) into its slots of ``values`` (each slot's own value there:
        0.0, or the ``NORMS`` slot's device total of the state): NaN when a value is not finite, else the largest
        (the inputs' dtype extremes left out); ``suspicious``: the ``SUSPICIOUS`` slot takes the inputs' value, for
        the host's comparison. The gradients' norms also give :attr:`grad_norm`."""
        if self.norms is not None:  # in float64, without overflow (float32 would overflow past norms of ~1e19)
            start, n = self.norms
            self.grad_norm = math.hypot(*values[at + start : at + start + n])
        start, n = self.op
        if math.isfinite(sum(values[at:])) and not (n and any(values[at + start : at + start + n])):
            # the usual step: every value finite (float32 values: their float64 sum cannot overflow) and no op flag
            # set, so no slot is seen; only the inputs' largest value is wanted, for the host's comparison
            if suspicious:
                largest = values[flags.INPUT]  # the largest unmasked input value of the tail, its values all finite
                for start, n, modulus in self.inputs:
                    part = max(map(abs, values[at + start : at + start + n]))
                    if modulus is not None and part >= modulus:  # a dtype's extreme among them: left out
                        part = checks.unmasked_on_host(values[at + start : at + start + n], modulus, finite=True)
                    if part > largest:
                        largest = part
                values[flags.INPUT] = values[flags.SUSPICIOUS] = largest
            return
        for slot, n, modulus in self.parts:
            part = checks.unmasked_on_host(values[at : at + n], modulus)
            old = values[slot]
            values[slot] = max(old, part) if math.isfinite(part) and math.isfinite(old) else math.nan
            at += n
        if suspicious:
            values[flags.SUSPICIOUS] = values[flags.INPUT]
