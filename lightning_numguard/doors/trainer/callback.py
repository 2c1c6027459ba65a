"""``NumGuardCallback``: catch NaN/Inf on every training step, name the culprit, survive it.

The callback is an adapter: configuration, state, and hooks that are one-line delegations to the step's flow
(:class:`~lightning_numguard.engine.flow.StepFlow`, which writes the step's order once). The work is done by
parts with one job each (see ``ARCHITECTURE.md``), wired once per fit into one
:class:`~lightning_numguard.engine.pipeline.StepPipeline`:

* :class:`~lightning_numguard.engine.record.StepRecorder`: what the step saw, on the device;
* :class:`~lightning_numguard.engine.read.StepRead`: the step's one packed read;
* :func:`~lightning_numguard.diagnose.builder.diagnose`: the culprits of a hit, in causal order;
* :func:`~lightning_numguard.decide.judge.judge`: what to do about it;
* :class:`~lightning_numguard.state.recovery.Recovery`: the only part that changes training state;
* :class:`~lightning_numguard.reporting.ledger.Ledger`: the only owner of events and counters.

``sync_mode`` only changes when the read happens: the read schedule
(:mod:`~lightning_numguard.engine.schedule`; ``"deferred"``:
:mod:`~lightning_numguard.engine.deferred`).
The class docstring (the contract and LightningCLI's ``--help``) is in :mod:`~lightning_numguard.config.doc`.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from lightning_numguard import _compat
from lightning_numguard.config.argtypes import plain_args
from lightning_numguard.config.arguments import GuardConfig
from lightning_numguard.config.doc import DOC
from lightning_numguard.doors.trainer.loop import TrainerLoop
from lightning_numguard.doors.trainer.nofiles import check_folder, files_folder, halt_folder
from lightning_numguard.doors.trainer.strategies import check_strategy
from lightning_numguard.engine.flow import StepFlow
from lightning_numguard.engine.guard import GuardState

__all__ = ["NumGuardCallback"]

log = logging.getLogger(__name__)

_STATE_KEY = "NumGuardCallback"


class NumGuardCallback(GuardConfig, GuardState, Callback):
    __doc__ = DOC

    def __post_init__(self) -> None:
        super().__post_init__()
        self._flow = StepFlow(self.config)
        self._fit_loop: TrainerLoop | None = None

    #: ``"NumGuardCallback"``: one guard per Trainer, whose state follows it across changes of ``dirpath`` or
    #: ``action`` and between the ``pytorch_lightning`` and ``lightning.pytorch`` classes. A plain attribute, not
    #: Lightning's property: Lightning asks for it at every hook it calls.
    state_key = _STATE_KEY

    @override
    def state_dict(self) -> dict[str, Any]:
        return GuardState.state_dict(self)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        GuardState.load_state_dict(self, state_dict)

    # ------------------------------------------------------------------ hooks: the step's flow

    def _loop(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainerLoop:
        """The trainer in the engine's terms (one per fit)."""
        loop = self._fit_loop
        if loop is None or loop.trainer is not trainer or loop.module is not pl_module:
            loop = self._fit_loop = TrainerLoop(trainer, pl_module, self._flow.settings.recovery.restore_callbacks)
        return loop

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _compat.require_accumulation_api(trainer)
        config = self._flow.settings
        check_strategy(trainer.strategy, config.action)
        self._fit_loop = TrainerLoop(trainer, pl_module, config.recovery.restore_callbacks)
        folder = files_folder(trainer, config.dirpath)
        if folder is not None:  # before the first step, on every rank: the files the guard exists to write
            check_folder(folder, given=bool(config.dirpath))
        self._flow = self._flow.setup(pl_module, config, folder, halt_folder(trainer))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flow.at_fit_start(self._loop(trainer, pl_module))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flow.at_train_start(self._loop(trainer, pl_module))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._flow.batch_start(self._loop(trainer, pl_module), batch, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._flow.before_backward(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._flow.before_optimizer_step(self._loop(trainer, pl_module), optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._flow.batch_end(self._loop(trainer, pl_module))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flow.at_train_end(self._loop(trainer, pl_module))

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Last line of defence: no checkpoint written during the run holds non-finite weights (see
        :meth:`StepPipeline.swap_checkpoint
        <lightning_numguard.engine.pipeline.StepPipeline.swap_checkpoint>`)."""
        self._flow.at_save_checkpoint(self._loop(trainer, pl_module), checkpoint)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end(trainer, pl_module, stage == "fit")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end(trainer, pl_module, trainer.state.fn == "fit", exception)

    def _end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, fit: bool, exception: BaseException | None = None
    ) -> None:
        loop = self._loop(trainer, pl_module)
        self._flow.at_end(loop, fit, exception)
        loop.logged.release()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fit_loop"] = None  # the trainer of a running fit stays with it
        return state


# LightningCLI's --help prints the Args: entries: plain text there, RST in the source.
NumGuardCallback.__doc__ = plain_args(NumGuardCallback.__doc__)
