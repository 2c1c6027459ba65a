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
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from lightning_numguard import _compat
from lightning_numguard.config import validate as _config
from lightning_numguard.config.argtypes import (
    Backoff,
    Headroom,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    plain_args,
)
from lightning_numguard.config.doc import DOC
from lightning_numguard.config.validate import CHECKS, DEFAULT_CHECKS, Action, CheckSite
from lightning_numguard.detect.registry import Check
from lightning_numguard.doors.trainer.loop import TrainerLoop
from lightning_numguard.doors.trainer.nofiles import files_folder
from lightning_numguard.doors.trainer.strategies import check_strategy
from lightning_numguard.engine.flow import StepFlow
from lightning_numguard.engine.pipeline import Settings, StepPipeline
from lightning_numguard.engine.schedule import SYNC_MODES
from lightning_numguard.errors import NumGuardError
from lightning_numguard.state.gather import SHARDING
from lightning_numguard.state.quarantine import parse_state
from lightning_numguard.state.snapshots import SnapshotsView

__all__ = ["CHECKS", "DEFAULT_CHECKS", "NumGuardCallback"]

log = logging.getLogger(__name__)

_STATE_KEY = "NumGuardCallback"
#: the layout of :meth:`NumGuardCallback.state_dict`; ``load_state_dict`` refuses any other
_STATE_VERSION = 1


class NumGuardCallback(Callback):
    __doc__ = DOC

    def __init__(
        self,
        action: Action = "rollback",
        dirpath: str | None = None,
        check: list[CheckSite] = list(DEFAULT_CHECKS),  # noqa: B006 - shown as the default in --help
        max_abs_input: PositiveFloat | None = 1e18,
        watch_modules: list[str] = ["*"],  # noqa: B006
        ignore_modules: list[str] = [],  # noqa: B006
        watch_depth: PositiveInt | None = 1,
        check_optimizer_coverage: Literal["off", "warn", "error"] = "warn",
        snapshot_every_n_steps: PositiveInt = 50,
        snapshot_device: Literal["host", "device"] = "host",
        max_rollbacks: NonNegativeInt = 10,
        halt_raises: bool = True,
        skip_batches_after_rollback: NonNegativeInt = 0,
        lr_backoff: Backoff = 1.0,
        retry_transient: bool = False,
        quarantine: bool = True,
        replay: bool = True,
        emit_warnings: bool = True,
        sync_mode: Literal["every_step", "deferred"] = "every_step",
        snapshot_sharding: Literal["auto", "off"] = "auto",
        snapshot_async: bool | None = None,
        spike_action: Literal["warn", "skip", "rollback"] | None = None,
        spike_sigma: PositiveFloat = 10.0,
        spike_window: NonNegativeInt = 128,
        spike_warmup: PositiveInt | None = None,
        spike_rollback_after: NonNegativeInt = 3,
        overflow_headroom: Headroom | None = 8.0,
        extra_checks: list[Check] | None = None,
    ) -> None:
        super().__init__()
        _config.choice("sync_mode", sync_mode, SYNC_MODES)
        if sync_mode == "deferred" and retry_transient:
            raise _config.NumGuardConfigError(
                "`retry_transient=True` re-runs a batch on the host's decision, which `sync_mode='deferred'` "
                "makes one step late: use one or the other"
            )
        self.sync_mode = sync_mode
        _config.choice("action", action, _config.ACTIONS)
        _config.choice("check_optimizer_coverage", check_optimizer_coverage, ("off", "warn", "error"))
        _config.choice("snapshot_device", snapshot_device, ("host", "device"))
        _config.choice("snapshot_sharding", snapshot_sharding, SHARDING)
        self.snapshot_sharding = snapshot_sharding
        self.snapshot_async = _config.flag_or_none("snapshot_async", snapshot_async)
        self.check = _config.checks(check)
        self.watch_modules = _config.patterns("watch_modules", watch_modules)
        self.ignore_modules = _config.patterns("ignore_modules", ignore_modules)
        if watch_depth is not None:
            _config.integer("watch_depth", watch_depth, 1)
        self.watch_depth = None if watch_depth is None else int(watch_depth)  # plain, from a CLI's restricted int
        self.max_abs_input = _config.positive_or_none("max_abs_input", max_abs_input)
        for name, value, minimum in (
            ("snapshot_every_n_steps", snapshot_every_n_steps, 1),
            ("max_rollbacks", max_rollbacks, 0),
            ("skip_batches_after_rollback", skip_batches_after_rollback, 0),
        ):
            _config.integer(name, value, minimum)
        self.lr_backoff = _config.fraction("lr_backoff", lr_backoff)
        for name, value in (("retry_transient", retry_transient), ("quarantine", quarantine), ("replay", replay)):
            _config.flag(name, value)
        for name, value in (("halt_raises", halt_raises), ("emit_warnings", emit_warnings)):
            _config.flag(name, value)
        self.halt_raises = halt_raises
        self.dirpath = _config.path_or_none("dirpath", dirpath)
        self.action = action
        self.check_optimizer_coverage = check_optimizer_coverage
        self.snapshot_every_n_steps = int(snapshot_every_n_steps)
        self.snapshot_device = snapshot_device
        self.max_rollbacks = int(max_rollbacks)
        self.skip_batches_after_rollback = int(skip_batches_after_rollback)
        self.retry_transient = retry_transient
        self.quarantine = quarantine
        self.replay = replay
        self.emit_warnings = emit_warnings
        self.spike_sigma, self.spike_warmup, self.overflow_headroom = _config.spike_settings(
            action, spike_action, spike_sigma, spike_window, spike_warmup, spike_rollback_after, overflow_headroom
        )
        self.spike_action = spike_action
        self.spike_window = int(spike_window)
        self.spike_rollback_after = int(spike_rollback_after)
        self.extra_checks = _config.extra_checks(extra_checks)
        self._flow = StepFlow(self._settings())
        self._fit_loop: TrainerLoop | None = None

    def _settings(self) -> Settings:
        """The validated arguments the fit's parts act on (read again in ``setup``)."""
        return Settings(**{f.name: getattr(self, f.name) for f in fields(Settings)})

    @property
    def _pipeline(self) -> StepPipeline:
        """The parts of the current fit (the flow's pipeline)."""
        return self._flow.pipeline

    # ------------------------------------------------------------------ public state

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event recorded so far in this fit (the same content as ``events.jsonl``)."""
        return self._pipeline.ledger.events

    @property
    def counters(self) -> dict[str, int]:
        """``incidents``, ``skipped_steps``, ``rollbacks`` and ``amp_overflow_steps`` so far."""
        return self._pipeline.ledger.counters

    @property
    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantined batches (epoch, batch_idx, step, reason, sample_indices, file)."""
        return self._pipeline.recovery.quarantine.entries

    @property
    def snapshots(self) -> SnapshotsView:
        """A read-only view of the fit's verified-finite snapshots (``snapshot``, ``async_on``, ``spare``,
        ``pending``, ``late``); only the guard changes them."""
        return SnapshotsView(self._pipeline.snapshots)

    @property
    def snapshot_step(self) -> int | None:
        """The step whose start state the last verified-finite snapshot holds (``None`` before the first)."""
        snapshot = self._pipeline.snapshots.snapshot
        return snapshot.step if snapshot is not None else None

    @property
    def resolved_dirpath(self) -> Path | None:
        """The folder events and checkpoints are written to (known from ``setup`` on)."""
        reporter = self._pipeline.reporter
        return reporter.dirpath if reporter is not None else None

    @property
    @override
    def state_key(self) -> str:
        """``"NumGuardCallback"``: one guard per Trainer, whose state follows it across changes of ``dirpath``
        or ``action`` and between the ``pytorch_lightning`` and ``lightning.pytorch`` classes."""
        return _STATE_KEY

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "counters": dict(self.counters),
            "incidents_by_kind": dict(self._pipeline.ledger.incidents_by_kind),
            **self._pipeline.recovery.quarantine.state_dict(),
            "spike": self._pipeline.spike.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters, the quarantine and incident counts; nothing is changed if any part is malformed or the
        state is of a version this release does not know."""
        version = state_dict.get("version", _STATE_VERSION)
        if type(version) is not int or version != _STATE_VERSION:
            raise NumGuardError(
                f"NumGuard: the callback state in this checkpoint has version {version!r}; this release reads version "
                f"{_STATE_VERSION}. Resume with the release that wrote it (or upgrade lightning-numguard), or resume "
                "without this callback's state by removing checkpoint['callbacks'] entries for NumGuardCallback; the "
                "checkpoint's weights are unaffected."
            )
        parsers = {
            "counters": lambda raw: {str(k): int(v) for k, v in raw.items()},
            "quarantined": lambda raw: parse_state("quarantined", raw),
            "position_incidents": lambda raw: parse_state("position_incidents", raw),
            "incidents_by_kind": lambda raw: {str(k): int(v) for k, v in raw.items()},
        }
        parsed: dict[str, Any] = {}
        for key, parse in parsers.items():
            try:
                parsed[key] = parse(state_dict.get(key, [] if key == "quarantined" else {}))
            except (AttributeError, TypeError, ValueError) as err:
                raise NumGuardError(
                    f"NumGuard: the callback state in this checkpoint is malformed at {key!r} ({err}); the "
                    "checkpoint's weights are unaffected: resume without this callback's state by removing "
                    "checkpoint['callbacks'] entries for NumGuardCallback, or from another checkpoint."
                ) from None
        try:
            self._pipeline.spike.load_state_dict(dict(state_dict.get("spike") or {}))
        except (AttributeError, TypeError, ValueError, KeyError) as err:
            raise NumGuardError(
                f"NumGuard: the callback state in this checkpoint is malformed at 'spike' ({err}); the checkpoint's "
                "weights are unaffected: resume without this callback's state, or from another checkpoint."
            ) from None
        self._pipeline.ledger.load(parsed["counters"], parsed["incidents_by_kind"])
        self._pipeline.recovery.quarantine.load_state_dict(parsed)

    # ------------------------------------------------------------------ hooks: the step's flow

    def _loop(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainerLoop:
        """The trainer in the engine's terms (one per fit)."""
        loop = self._fit_loop
        if loop is None or loop.trainer is not trainer or loop.module is not pl_module:
            loop = self._fit_loop = TrainerLoop(trainer, pl_module)
        return loop

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _compat.require_accumulation_api(trainer)
        settings = self._settings()
        check_strategy(trainer.strategy, settings.action)
        self._fit_loop = TrainerLoop(trainer, pl_module)
        self._flow = self._flow.setup(pl_module, settings, files_folder(trainer, settings.dirpath))

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
