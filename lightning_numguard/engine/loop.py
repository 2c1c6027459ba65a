"""What the engine asks of the training loop it guards, in torch terms: the :class:`Loop`.

The engine never sees a ``Trainer``, a ``Fabric`` or a user's ``for`` loop. Each front door
(:mod:`lightning_numguard.doors`) hands it one :class:`Loop`: the root module and its optimizers, the step
(how many optimizer steps were taken, whether the current micro-batch accumulates), the process group, a quiet
way to run a micro-batch again (the replay and the retry), a place for checkpoints, and the loggers. The base
class is a single process with no loggers; a door overrides what its loop knows.

Every collective here is called by every rank at the same point (the engine only calls them after flags that
were reduced across ranks, so every rank takes the same branch).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["Loop"]


class Loop:
    """A training loop as the engine sees it. The defaults describe one process, no logger, no accumulation.

    Attributes:
        module: the root module whose forward pass is a step's forward pass (the ``LightningModule``, the model
            handed to ``fabric.setup`` or to :func:`lightning_numguard.attach`).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    # ------------------------------------------------------------------ the step

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (the Trainer's ``global_step``)."""
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        """The epoch in progress (``0`` for a loop that does not count epochs)."""
        return 0

    @property
    def max_steps(self) -> int:
        """The steps the run is set to take (``-1``: not known)."""
        return -1

    def accumulating(self) -> bool:
        """Whether the micro-batch in progress accumulates gradients (its optimizer step comes later)."""
        return False

    @property
    def device(self) -> torch.device:
        """The device of the module's first parameter or buffer (where a step's flags are made)."""
        for t in (*self.module.parameters(), *self.module.buffers()):
            return t.device
        return torch.device("cpu")

    # ------------------------------------------------------------------ what the step trains

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers (the torch objects themselves, not a framework's wrappers)."""
        raise NotImplementedError

    @property
    def schedulers(self) -> list[Any]:
        """The learning-rate schedulers a rollback puts back (objects with ``state_dict``/``load_state_dict``)."""
        return []

    @property
    def scaler(self) -> Any:
        """The fp16 ``GradScaler`` that steps the optimizers, or ``None``."""
        return None

    @property
    def automatic(self) -> bool:
        """Whether the loop steps the optimizers itself after the step's backward (``False``: the user's
        ``training_step`` steps them, Lightning's manual optimization)."""
        return True

    def stateful(self) -> dict[str, Any]:
        """Everything besides the module and the optimizers that a rollback must restore, by a name of its own
        (LR schedulers, the precision plugin, metrics, other callbacks' state): objects with ``state_dict`` and
        ``load_state_dict``, or :mod:`~lightning_numguard.state.stateful` adapters."""
        return {}

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the loop runs a step's forward pass in (the precision's autocast)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def rerun(self, batch: Any, batch_idx: int) -> Iterator[Callable[[], Any]]:
        """A way to run one micro-batch's forward pass (and loss) again, quietly: nothing logged, no optimizer
        stepped, no counter moved. Yields a closure returning the loss (or what the step returned: a tensor, a
        dict with ``"loss"``, ``None``); the caller runs its backward."""
        raise NotImplementedError
        yield  # pragma: no cover

    # ------------------------------------------------------------------ the process group

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_zero(self) -> bool:
        """Whether this is global rank 0 (the rank that writes files and loggers)."""
        return self.rank == 0

    @property
    def root_device(self) -> torch.device:
        """The device the process group's collectives run on (the CPU under gloo, the rank's GPU under NCCL)."""
        return self.device

    @property
    def local_shards(self) -> bool:
        """Whether parameters and optimizer state are ``DTensor`` local shards whose forward and backward passes are
        collective (FSDP2, tensor parallel): every rank replays together, checkpoints are folders."""
        return False

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the same whole parameters and optimizer state (data parallel), so that each
        may keep ``1/world`` of a snapshot."""
        return self.world_size > 1 and not self.local_shards

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``tensor`` over ranks (one all-reduce)."""
        return tensor

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank (a picklable object)."""
        return obj

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, in rank order."""
        return tensor.unsqueeze(0)

    def barrier(self, name: str) -> None:
        """Wait until every rank is here."""

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Gradients not synchronised across ranks (DDP's ``no_sync``): a re-run on this rank alone."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ files, loggers and stopping

    def save_checkpoint(self, path: Path) -> None:
        """Write the live state as the loop's own checkpoint at ``path`` (collective: every rank calls it)."""
        raise NotImplementedError

    def resume_hint(self, path: Path) -> str:
        """How to resume from the checkpoint at ``path`` that :meth:`save_checkpoint` wrote (a line of code)."""
        return f"torch.load({str(path)!r})"

    def checkpoint_states(self) -> tuple[dict[str, Any], list[Any]]:
        """The module's and each optimizer's state dicts as the loop's checkpoints hold them (collective when the
        state is sharded)."""
        return self.module.state_dict(), [o.state_dict() for o in self.optimizers]

    @property
    def loggers(self) -> list[Any]:
        """The loggers the guard writes its series and events to, on global rank 0 (Lightning's and Fabric's
        loggers: ``log_metrics(metrics, step)``; a ``TensorBoardLogger`` gets the events' text and the picture)."""
        return []

    @property
    def log_step(self) -> int:
        """The step number the loop's own metrics are written at now (the guard's series go beside them)."""
        return self.step

    def logs_due(self) -> bool:
        """Whether the loop writes its own metrics at this step (the guard's series go out on the same steps)."""
        return False

    def info(self, line: str) -> None:
        """An INFO line for the operator, where the loop's own start-up lines go (rank 0 only)."""
        if self.is_zero:
            logging.getLogger("lightning_numguard").info(line)

    def stop(self) -> None:
        """Ask the loop to stop after this step (every rank asks: the decision was taken together)."""

    def will_stop(self) -> bool:
        """Whether a :meth:`stop` asked now ends the run (Lightning honours it only after ``min_steps``)."""
        return False

    def discard_logged(self) -> None:
        """Withdraw what the step in progress logged through the loop's own metrics (a discarded step)."""

    def mark_logged(self) -> None:
        """A new step starts: what it logs from now on is what :meth:`discard_logged` withdraws."""

    def show(self, counts: dict[str, int]) -> None:
        """Show ``counts`` (progress-bar key -> a counter that is not zero) where the loop shows its progress."""

    @property
    def rich_console(self) -> bool:
        """Whether the loop draws its progress on Rich's console (the end-of-fit summary is then a Rich table)."""
        return False
