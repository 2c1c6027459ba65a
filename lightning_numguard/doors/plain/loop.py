"""A plain PyTorch training loop seen as the engine's :class:`~lightning_numguard.engine.loop.Loop`.

The loop is the user's own ``for`` loop: the guard knows its model(s), its optimizers and ``torch.distributed``
(when the user initialised it: every rank's guard takes part in the step's one all-reduce, so every rank acts
together). ``last_finite.ckpt`` is ``torch.save`` of the models', the optimizers' and the guard's states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_numguard.doors.torchstep import TorchLoop

__all__ = ["PlainLoop"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class PlainLoop(TorchLoop):
    """The user's loop over ``module`` (the attached model, or a container of several), called through ``tops``.

    ``guard_state``: the guard's own state (written into ``last_finite.ckpt``).
    """

    def __init__(self, module: nn.Module, tops: list[nn.Module], guard_state: Callable[[], dict[str, Any]]) -> None:
        super().__init__(module, tops)
        self.guard_state = guard_state

    # ------------------------------------------------------------------ the process group

    @property
    def rank(self) -> int:
        return dist.get_rank() if _distributed() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if _distributed() else 1

    @property
    def root_device(self) -> torch.device:
        """The device collectives run on: the CPU under gloo, this rank's GPU under NCCL."""
        if _distributed() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu") if _distributed() else self.device

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().to(self.root_device).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out.to(tensor.device)

    def broadcast(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.detach().to(self.root_device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.stack(parts).to(tensor.device)

    def barrier(self, name: str) -> None:
        if _distributed():
            dist.barrier()

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """DDP's ``no_sync`` on every DDP-wrapped top module (a re-run on this rank alone)."""
        stack = contextlib.ExitStack()
        for top in self.tops:
            no_sync = getattr(top, "no_sync", None)
            if callable(no_sync):
                stack.enter_context(no_sync())
        return stack

    # ------------------------------------------------------------------ files

    def save_checkpoint(self, path: Path) -> None:
        """``torch.save`` of the models' state (``"model"``), each optimizer's (``"optimizers"``) and the guard's
        (``"numguard"``), on global rank 0 (every rank holds the same replicated state)."""
        if self.is_zero:
            states = [o.state_dict() for o in self.optimizers]
            torch.save({"model": self.module.state_dict(), "optimizers": states, "numguard": self.guard_state()}, path)

    def resume_hint(self, path: Path) -> str:
        return (
            f"state = torch.load({str(path)!r}, weights_only=False); model.load_state_dict(state['model']); "
            "optimizer.load_state_dict(state['optimizers'][0]); guard.load_state_dict(state['numguard'])"
        )
