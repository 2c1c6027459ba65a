"""The Lightning ``Trainer`` seen as the engine's :class:`~lightning_numguard.engine.loop.Loop`.

Everything the engine asks of a training loop is answered here from the ``Trainer`` and its ``LightningModule``:
the step (``global_step``, accumulation), the optimizers and schedulers, the precision plugin, the strategy's
collectives, ``training_step`` run again quietly, checkpoints, loggers and the progress bar. Both Lightning packages
(``pytorch_lightning`` and ``lightning.pytorch``) are served by duck typing: the attributes used here are the ones
they share. Private Lightning names are reached through :mod:`lightning_numguard._compat`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.utilities import rank_zero_info

from lightning_numguard import _compat
from lightning_numguard.doors.trainer.held import held_states
from lightning_numguard.doors.trainer.logged import LoggedValues
from lightning_numguard.doors.trainer.strategies import holds_local_shards, replicates_state
from lightning_numguard.engine.loop import Loop
from lightning_numguard.state.snapshot import Stateful
from lightning_numguard.state.stateful import PrecisionState, module_states

__all__ = ["TrainerLoop"]


class TrainerLoop(Loop):
    """A ``Trainer`` fitting a ``LightningModule``, in the engine's terms."""

    def __init__(self, trainer: Any, pl_module: Any, restore_callbacks: Sequence[str] = ()) -> None:
        super().__init__(pl_module)
        self.trainer = trainer
        self.restore_callbacks = tuple(restore_callbacks)  # ``recovery.restore_callbacks``: other callbacks restored
        self.pl_module: Any = pl_module  # the LightningModule, duck-typed (either Lightning package)
        self.logged = LoggedValues()  # what a discarded step logged is withdrawn from Lightning's results

    # ------------------------------------------------------------------ the step

    @property
    def step(self) -> int:
        return int(self.trainer.global_step)

    @property
    def epoch(self) -> int:
        return int(self.trainer.current_epoch)

    @property
    def max_steps(self) -> int:
        return int(self.trainer.max_steps)

    def accumulating(self) -> bool:
        return _compat.should_accumulate(self.trainer)

    @property
    def device(self) -> torch.device:
        return self.pl_module.device

    # ------------------------------------------------------------------ what the step trains

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.trainer.optimizers)

    @property
    def schedulers(self) -> list[Any]:
        return [c.scheduler for c in self.trainer.lr_scheduler_configs]

    @property
    def scaler(self) -> Any:
        return getattr(self.trainer.precision_plugin, "scaler", None)

    @property
    def automatic(self) -> bool:
        return bool(self.pl_module.automatic_optimization)

    def stateful(self) -> dict[str, Stateful]:
        """The LR schedulers, the precision plugin's scaler, the module's metrics, numpy's RNG, and what the other
        callbacks hold that a rollback puts back (:mod:`~lightning_numguard.doors.trainer.held`: Lightning's weight
        averages, the callbacks ``recovery.restore_callbacks`` names)."""
        out: dict[str, Stateful] = {f"lr_scheduler:{i}": s for i, s in enumerate(self.schedulers)}
        plugin = self.trainer.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            out["precision"] = PrecisionState(plugin)
        out.update(module_states(self.module))
        out.update(held_states(self.trainer.callbacks, self.module, self.restore_callbacks))
        return out

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.trainer.precision_plugin.train_step_context()

    @contextlib.contextmanager
    def rerun(self, batch: Any, batch_idx: int) -> Iterator[Callable[[], Any]]:
        """``training_step`` again, quietly: ``self.log`` goes nowhere, every optimizer's ``step`` only runs its
        closure (under manual optimization ``training_step`` calls ``opt.step()`` itself: neither the weights nor
        Lightning's step counters move), ``manual_backward`` only collects the loss (the caller runs the backward,
        of their sum), all under the precision plugin's autocast."""
        module = self.pl_module
        losses: list[torch.Tensor] = []

        def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            losses.append(loss)

        def run_step() -> Any:
            losses.clear()
            out = module.training_step(batch, batch_idx)
            if out is None and losses:
                graph = [x.sum() for x in losses if x.requires_grad]
                return torch.stack(graph).sum() if graph else None
            return out

        with contextlib.ExitStack() as stack:
            stack.enter_context(_patched(module, log=_ignore, log_dict=_ignore, manual_backward=manual_backward))
            for opt in self._step_owners():
                stack.enter_context(_patched(opt, step=_closure_only))
            stack.enter_context(self.autocast())
            yield run_step

    def _step_owners(self) -> list[Any]:
        """The optimizers and Lightning's wrappers of them whose ``step`` a re-run must neutralise."""
        found: list[Any] = list(self.trainer.optimizers)
        try:
            wrapped = self.pl_module.optimizers(use_pl_optimizer=True)
        except Exception:  # no trainer attached, or no optimizers
            wrapped = []
        found.extend(wrapped if isinstance(wrapped, list) else [wrapped])
        return [o for o in found if hasattr(o, "__dict__")]

    # ------------------------------------------------------------------ the process group

    @functools.cached_property
    def rank(self) -> int:
        """The trainer's global rank, read once per fit (the strategy sets it up before the fit's first hook)."""
        return int(self.trainer.global_rank)

    @functools.cached_property
    def world_size(self) -> int:
        """The trainer's world size, read once per fit (asked at every step's read)."""
        return int(self.trainer.world_size)

    @property
    def root_device(self) -> torch.device:
        return self.trainer.strategy.root_device

    @property
    def local_shards(self) -> bool:
        return self.world_size > 1 and holds_local_shards(self.trainer.strategy)

    @property
    def replicated(self) -> bool:
        return self.world_size > 1 and replicates_state(self.trainer.strategy)

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(tensor, reduce_op="max")

    def broadcast(self, obj: Any, src: int) -> Any:
        # Lightning strategies have no all_gather_object; their broadcast takes any picklable object
        return self.trainer.strategy.broadcast(obj, src=src)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.all_gather(tensor)

    def barrier(self, name: str) -> None:
        self.trainer.strategy.barrier(name)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        no_sync = getattr(self.trainer.strategy.model, "no_sync", None)
        return no_sync() if callable(no_sync) else contextlib.nullcontext()

    # ------------------------------------------------------------------ files, loggers and stopping

    def save_checkpoint(self, path: Path) -> None:
        """A normal Lightning checkpoint (``Trainer.fit(ckpt_path=...)``, ``load_from_checkpoint``)."""
        self.trainer.save_checkpoint(path, weights_only=False)

    def resume_hint(self, path: Path) -> str:
        return f"trainer.fit(model, ckpt_path={str(path)!r})"

    def checkpoint_states(self) -> tuple[dict[str, Any], list[Any]]:
        strategy = self.trainer.strategy
        return strategy.lightning_module_state_dict(), [strategy.optimizer_state(o) for o in self.optimizers]

    @property
    def loggers(self) -> list[Any]:
        return list(self.trainer.loggers)

    @property
    def log_step(self) -> int:
        return _compat.logging_step(self.trainer)

    def logs_due(self) -> bool:
        return _compat.logs_due(self.trainer)

    def info(self, line: str) -> None:
        """Lightning's own INFO line on rank 0, where its fit-start lines go."""
        rank_zero_info(line)

    def stop(self) -> None:
        self.trainer.should_stop = True

    def will_stop(self) -> bool:
        return _compat.lightning_will_stop(self.trainer)

    def discard_logged(self) -> None:
        self.logged.discard(self.trainer)

    def mark_logged(self) -> None:
        self.logged.mark(self.trainer)

    def show(self, counts: dict[str, int]) -> None:
        """Integers in the progress bar (``pl_module.log`` would store them as floats, shown as "1.000")."""
        if getattr(self.trainer, "progress_bar_callback", None) is None:
            return
        shown = self.trainer.progress_bar_metrics  # the connector's own dict, kept between batches (a public property)
        if isinstance(shown, dict):
            shown.update(counts)

    @property
    def rich_console(self) -> bool:
        bar = getattr(self.trainer, "progress_bar_callback", None)
        return any(cls.__name__ == "RichProgressBar" for cls in type(bar).__mro__) if bar is not None else False


@contextlib.contextmanager
def _patched(obj: Any, **attrs: Any) -> Iterator[None]:
    """Set instance attributes of ``obj`` for the duration, then put back exactly what was there."""
    saved = {name: obj.__dict__.get(name, _MISSING) for name in attrs}
    obj.__dict__.update(attrs)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value


_MISSING = object()


def _closure_only(closure: Any = None, **kwargs: Any) -> Any:
    """An optimizer ``step`` that runs its closure (forward and backward) and changes nothing."""
    return closure() if callable(closure) else None


def _ignore(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during a re-run: the re-run's values stay out of the run's metrics."""
