"""The variants compared by ``benchmarks.overhead``: name -> (extra ``Trainer`` kwargs, callbacks).

Variants:
  baseline                      plain ``pl.Trainer`` (logger=False, no checkpointing, progress bar, summary)
  numguard_default              ``NumGuardCallback()`` (default checks, snapshot every 50 steps; spike statistics
                                and overflow headroom on, ``spike_action=None``)
  numguard_no_spike             defaults with ``spike_window=0, overflow_headroom=None`` (no spike statistics: the
                                defaults before them, the reference for their cost)
  numguard_spike_skip           defaults with ``spike_action="skip"`` (a spike would be skipped; none is here)
  numguard_all                  every check every step: output hooks, parameters, optimizer state
  numguard_all_no_outputs       every check but ``outputs`` (the forward hooks off)
  numguard_no_ops               defaults without ``ops`` (no TorchFunctionMode)
  numguard_no_outputs           defaults without ``outputs`` (no forward hooks on the blocks)
  numguard_no_inputs            defaults without ``inputs`` (the batch not checked)
  numguard_snapshot_every_step  defaults with ``snapshot_every_n_steps=1``
  numguard_deferred             defaults with ``sync_mode="deferred"`` (no host read per step)
  detect_anomaly                ``Trainer(detect_anomaly=True)``
  spike_detection               Lightning's ``SpikeDetection`` callback (loss spikes, ``mode="min"``)
  naive_isfinite                ``bool(torch.isfinite(p.grad).all())`` per parameter tensor,
                                in ``on_before_optimizer_step``
  floor_default                 ``instruments.floor.FloorGuard()``: only the reads the defaults make (inputs, block
                                outputs, loss, gradients), one host read, no machinery: the floor under the defaults
  floor_no_outputs              ``FloorGuard(outputs=False)``: the floor without the block outputs' reads (their
                                forward hooks), the reference for what reading the outputs costs at the least
  floor_all                     ``FloorGuard(every=True)``: parameters and optimizer state too (the floor under
                                ``numguard_all``)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.callbacks import Callback, SpikeDetection

from instruments.floor import FloorGuard
from lightning_numguard.callbacks import NumGuardCallback

__all__ = [
    "ALL_CHECKS",
    "DEFAULT_CHECKS",
    "FLOOR_PARTS",
    "PARTS",
    "VARIANTS",
    "NaiveIsFinite",
    "incidents",
    "make_variant",
]

VARIANTS = (
    "baseline",
    "numguard_default",
    "numguard_no_spike",
    "numguard_spike_skip",
    "numguard_all",
    "numguard_all_no_outputs",
    "numguard_no_ops",
    "numguard_no_outputs",
    "numguard_no_inputs",
    "numguard_snapshot_every_step",
    "numguard_deferred",
    "detect_anomaly",
    "spike_detection",
    "naive_isfinite",
    "floor_default",
    "floor_no_outputs",
    "floor_all",
)
ALL_CHECKS = ["inputs", "outputs", "ops", "loss", "grads", "buffers", "params", "optimizer_state"]
DEFAULT_CHECKS = list(inspect.signature(NumGuardCallback).parameters["check"].default)
#: the defaults with one part left out, by the part (what the part costs is ``numguard_default`` minus the variant)
PARTS = {
    "numguard_no_outputs": "the block outputs (`outputs`)",
    "numguard_no_inputs": "the batch (`inputs`)",
    "numguard_no_ops": "the op guard (`ops`)",
    "numguard_no_spike": "the spike statistics and overflow headroom (`spikes`)",
}
#: the floor with one part left out (what it costs is ``floor_default`` minus the variant)
FLOOR_PARTS = {"floor_no_outputs": "the floor's block outputs (a `sum` each)"}


class NaiveIsFinite(Callback):
    """What people write first: one ``bool()`` (a host sync on GPU) per gradient tensor."""

    def __init__(self) -> None:
        self.bad_steps = 0

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for p in pl_module.parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                self.bad_steps += 1
                optimizer.zero_grad(set_to_none=True)
                return


def make_variant(name: str, tmp: Path) -> tuple[dict[str, Any], list[Callback]]:
    """``(extra Trainer kwargs, callbacks)`` for variant ``name``; fresh objects every call."""
    ng = str(tmp / "numguard")
    guard: dict[str, Callable[[], Any]] = {
        "numguard_default": lambda: NumGuardCallback(dirpath=ng),
        "numguard_no_spike": lambda: NumGuardCallback(dirpath=ng, spikes={"window": 0, "overflow_headroom": None}),
        "numguard_spike_skip": lambda: NumGuardCallback(dirpath=ng, spike_action="skip"),
        "numguard_all": lambda: NumGuardCallback(dirpath=ng, check=list(ALL_CHECKS)),
        "numguard_snapshot_every_step": lambda: NumGuardCallback(dirpath=ng, snapshot_every_n_steps=1),
        "numguard_deferred": lambda: NumGuardCallback(dirpath=ng, sync_mode="deferred"),
        "numguard_all_no_outputs": lambda: NumGuardCallback(
            dirpath=ng, check=[c for c in ALL_CHECKS if c != "outputs"]
        ),
        "numguard_no_ops": lambda: NumGuardCallback(dirpath=ng, check=[c for c in DEFAULT_CHECKS if c != "ops"]),
        "numguard_no_outputs": lambda: NumGuardCallback(
            dirpath=ng, check=[c for c in DEFAULT_CHECKS if c != "outputs"]
        ),
        "numguard_no_inputs": lambda: NumGuardCallback(dirpath=ng, check=[c for c in DEFAULT_CHECKS if c != "inputs"]),
        "spike_detection": lambda: SpikeDetection(mode="min", exclude_batches_path=str(tmp / "spike")),
        "naive_isfinite": NaiveIsFinite,
        "floor_default": FloorGuard,
        "floor_no_outputs": lambda: FloorGuard(outputs=False),
        "floor_all": lambda: FloorGuard(every=True),
    }
    if name == "baseline":
        return {}, []
    if name == "detect_anomaly":
        return {"detect_anomaly": True}, []
    if name in guard:
        return {}, [guard[name]()]
    raise ValueError(f"unknown variant {name!r}; choose from {list(VARIANTS)}")


def incidents(callbacks: list[Callback]) -> int:
    """Incidents the variant's callbacks recorded in one fit (none is expected: the data is finite)."""
    n = 0
    for cb in callbacks:
        if isinstance(cb, NumGuardCallback):
            n += sum(1 for e in cb.events if e["kind"] != "optimizer_coverage")
        if isinstance(cb, (NaiveIsFinite, FloorGuard)):
            n += cb.bad_steps
    return n
