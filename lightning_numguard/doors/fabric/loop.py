"""A Lightning Fabric training loop seen as the engine's :class:`~lightning_numguard.engine.loop.Loop`.

Everything is asked of the ``Fabric`` object itself, by duck typing (``lightning.fabric`` and ``lightning_fabric``
share these public attributes): its rank and world, its collectives (``all_reduce``, ``broadcast``,
``all_gather``, ``barrier``), ``no_backward_sync``, ``save`` (``last_finite.ckpt`` loads with ``fabric.load``) and
its loggers. The loop itself (the step, accumulation, the optimizers) is what the Fabric door learned from its
hooks (:mod:`~lightning_numguard.doors.torchstep`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_numguard.doors.torchstep import TorchLoop

__all__ = ["LOG_EVERY_N_STEPS", "FabricLoop", "files_folder"]

#: the guard's series go to Fabric's loggers every this many steps (Lightning's own default), and at every event
LOG_EVERY_N_STEPS = 50


def files_folder(fabric: Any, dirpath: str | None) -> Path:
    """Where the guard's files go: ``dirpath``, else ``<log_dir>/numguard`` of Fabric's first logger that has a
    log folder, else ``./numguard``."""
    if dirpath:
        return Path(dirpath)
    for logger in getattr(fabric, "loggers", None) or []:
        log_dir = getattr(logger, "log_dir", None)
        if isinstance(log_dir, (str, Path)) and str(log_dir):
            return Path(log_dir) / "numguard"
    return Path.cwd() / "numguard"


class FabricLoop(TorchLoop):
    """A Fabric loop over ``module`` (the model handed to ``fabric.setup``), called through ``top`` (what
    ``fabric.setup`` returned). ``guard_state``: the guard's own state (written into ``last_finite.ckpt``);
    ``no_backward_sync``: Fabric's own (the door wraps the instance's)."""

    def __init__(
        self,
        fabric: Any,
        module: nn.Module,
        top: nn.Module,
        guard_state: Callable[[], dict[str, Any]],
        no_backward_sync: Callable[..., Any],
    ) -> None:
        super().__init__(module, [top])
        self.fabric = fabric
        self.guard_state = guard_state
        self._no_backward_sync = no_backward_sync
        self.in_no_sync = False  # inside ``fabric.no_backward_sync(model, enabled=True)``: a micro-batch accumulates

    def accumulating(self) -> bool:
        return self.in_no_sync

    # ------------------------------------------------------------------ the process group

    @property
    def rank(self) -> int:
        return int(self.fabric.global_rank)

    @property
    def world_size(self) -> int:
        return int(self.fabric.world_size)

    @property
    def root_device(self) -> torch.device:
        return torch.device(self.fabric.device)

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.fabric.all_reduce(tensor, reduce_op="max")

    def broadcast(self, obj: Any, src: int) -> Any:
        return self.fabric.broadcast(obj, src=src)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.fabric.all_gather(tensor)

    def barrier(self, name: str) -> None:
        self.fabric.barrier(name)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self._no_backward_sync(self.tops[0], enabled=True)

    # ------------------------------------------------------------------ files and loggers

    def save_checkpoint(self, path: Path) -> None:
        """``fabric.save`` of the model, the optimizers and the guard's state (collective: every rank calls it)."""
        opts = self.optimizers
        named = {"optimizer": opts[0]} if len(opts) == 1 else {f"optimizer{i}": o for i, o in enumerate(opts)}
        self.fabric.save(path, {"model": self.tops[0], **named, "numguard": self.guard_state()})

    def resume_hint(self, path: Path) -> str:
        names = "'optimizer': optimizer" if len(self.optimizer_list) == 1 else "'optimizer0': optimizer0, ..."
        return f"fabric.load({str(path)!r}, {{'model': model, {names}, 'numguard': guard}})"

    @property
    def loggers(self) -> list[Any]:
        return list(getattr(self.fabric, "loggers", None) or [])

    def logs_due(self) -> bool:
        return self.step % LOG_EVERY_N_STEPS == 0
