"""``NumGuardCallback``: catch NaN/Inf on every training step, name the culprit, survive it.

The callback is an adapter: configuration, state and hooks of a few lines. The work is done by
parts with one job each (see ``ARCHITECTURE.md``), wired once per fit into one
:class:`~lightning_numguard.callbacks._pipeline.StepPipeline`:

* :class:`~lightning_numguard.callbacks._record.StepRecorder`: what the step saw, on the device;
* :class:`~lightning_numguard.callbacks._read.StepRead`: the step's one packed read;
* :func:`~lightning_numguard.callbacks._diagnosis.diagnose`: the culprits of a hit, in causal order;
* :func:`~lightning_numguard.core.judge.judge`: what to do about it;
* :class:`~lightning_numguard.callbacks._recovery.Recovery`: the only part that changes training state;
* :class:`~lightning_numguard.callbacks._ledger.Ledger`: the only owner of events and counters.

``sync_mode="deferred"`` only changes when the read happens (:mod:`~lightning_numguard.callbacks._zerosync`).
The class docstring (the contract and LightningCLI's ``--help``) is in :mod:`~lightning_numguard.callbacks._doc`.
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
from lightning_numguard.callbacks import _config, _nofiles
from lightning_numguard.callbacks._config import CHECKS, DEFAULT_CHECKS, Action, Check
from lightning_numguard.callbacks._coverage import CoverageCheck
from lightning_numguard.callbacks._doc import DOC
from lightning_numguard.callbacks._pipeline import Settings, StepPipeline
from lightning_numguard.callbacks._progress import FitProgress
from lightning_numguard.callbacks._series import RunSeries
from lightning_numguard.callbacks._sharded import SHARDING
from lightning_numguard.callbacks._snapshots import SnapshotsView, stateful_objects
from lightning_numguard.callbacks._spike import STATEFUL_KEY
from lightning_numguard.callbacks._strategies import check_strategy
from lightning_numguard.callbacks._types import (
    Backoff,
    Headroom,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    plain_args,
)
from lightning_numguard.callbacks._zerosync import SYNC_MODES, DeferredRead
from lightning_numguard.core.quarantine import parse_state
from lightning_numguard.errors import NumGuardError

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
        check: list[Check] = list(DEFAULT_CHECKS),  # noqa: B006 - shown as the default in --help
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
        self._fresh_run()

    def _fresh_run(self, dirpath: Path | None = None) -> None:
        """New parts for a fit (run in ``setup``, before Lightning loads this callback's state)."""
        settings = Settings(**{f.name: getattr(self, f.name) for f in fields(Settings)})
        self._pipeline = StepPipeline.build(settings, dirpath)
        self._reporter = self._pipeline.reporter
        self._coverage = CoverageCheck(self.check_optimizer_coverage)
        self._progress = FitProgress()
        self._series = RunSeries(self._reporter, self.spike_sigma if self._pipeline.spike.window is not None else None)
        self._deferred = DeferredRead(self._pipeline) if self.sync_mode == "deferred" else None

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
        return self._reporter.dirpath if self._reporter is not None else None

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

    def __getstate__(self) -> dict[str, Any]:
        # Hooks, the op-guard mode and the step record belong to a running fit; setup rebuilds them.
        state = self.__dict__.copy()
        state["_pipeline"] = self._pipeline.without_instruments()
        state["_deferred"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.sync_mode == "deferred":
            self._deferred = DeferredRead(self._pipeline)

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._pipeline.recorder.detach()
        _compat.require_accumulation_api(trainer)
        check_strategy(trainer.strategy, self.action)
        root = Path(trainer.log_dir or trainer.default_root_dir)
        dirpath = Path(self.dirpath) if self.dirpath else root / "numguard"
        self._fresh_run(dirpath if _nofiles.writes_files(trainer, self.dirpath) else None)  # None: no files
        self._pipeline.recorder.attach(pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        p = self._pipeline
        p.snapshots.stateful = stateful_objects(trainer, pl_module)
        if p.spike.window is not None:  # snapshots hold the spike window: a rollback puts it back
            p.snapshots.stateful[STATEFUL_KEY] = p.spike.window
        p.reader.resolve(pl_module, p.snapshots.stateful)
        self._coverage.at_fit_start(trainer, pl_module, p.ledger)
        p.announce_spikes(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning restored optimizers, schedulers and the scaler from a checkpoint (it does so after
        # on_fit_start): a snapshot taken earlier would roll a resumed run back to fresh optimizers.
        p = self._pipeline
        bad = p.recovery.at_train_start(trainer, pl_module, p.reader, self.action != "warn")
        # the fused check writes the same bits back: only while no snapshot is copied on another thread
        p.reader.state_rewritable = not p.snapshots.async_on
        if bad:
            p.halt_at_fit_start(trainer, bad)
        if self._deferred is not None:
            self._deferred.at_fit_start(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        p = self._pipeline
        new_step = p.recorder.record is None
        acting = self.action != "warn"
        rec = p.recorder.begin(trainer, pl_module, batch, batch_idx, acting, p.snapshots.stateful)
        p.recovery.flag_batch(rec, batch, batch_idx, trainer.global_step, new_step)
        if new_step and p.snapshots.async_on:  # start the due snapshot's copies, overlapped with the step
            p.snapshots.start(trainer, pl_module, p.due(trainer.global_step))
        if new_step and acting:
            p.recovery.logged.mark(trainer)
        p.recorder.enter_ops()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._pipeline.recorder.exit_ops()
        self._pipeline.recorder.record_loss(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        recorder = self._pipeline.recorder
        recorder.exit_ops()
        rec = recorder.record
        if rec is None:  # an optimizer step outside a training batch (manual loops)
            return
        if rec.read_done and rec.bad:  # a further optimizer of a bad batch (manual optimization)
            self._pipeline.recovery.drop_gradients(optimizer)
            return
        if rec.read_done:  # a further optimizer of a clean batch: its gradients only
            recorder.forget_forward()
        if rec.forced_skip is None:  # both read schedules: the gradients are known here, read or not
            self._coverage.at_first_step(trainer, pl_module, optimizer, self._pipeline.ledger)
        if self._deferred is not None:
            self._deferred.before_step(trainer, pl_module, optimizer)
            return
        self._pipeline.read(trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        p = self._pipeline
        p.recorder.exit_ops()
        rec = p.recorder.record
        if rec is None:
            return
        if not rec.read_done:
            if _compat.should_accumulate(trainer):
                return  # the window's records are read at its optimizer step
            p.read(trainer, pl_module, None)  # a batch without an optimizer step is read at its end
        p.recorder.end()
        p.spike.push()  # before the action: a rollback puts back the window of its snapshot
        if self._deferred is not None:
            self._deferred.after_step(trainer, pl_module)  # a late decision taken during this batch
        p.finish(trainer, pl_module, rec)
        self._progress.after_step(trainer, pl_module, rec, p.snapshots.snapshot, self.counters)
        p.amp.log(trainer, pl_module, self.counters["amp_overflow_steps"])
        last = p.spike.last  # host numbers: the counters and the spike statistics of the step's one read
        self._series.after_step(trainer, pl_module, rec.step, self.events, self.counters, last, p.spike.scalars())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deferred is not None:
            self._deferred.at_train_end(trainer, pl_module)
        self._pipeline.at_train_end(trainer, pl_module)  # the last step's update: checked once (one sync per fit)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Last line of defence: no checkpoint written during the run holds non-finite weights (see
        :meth:`StepPipeline.swap_checkpoint <lightning_numguard.callbacks._pipeline.StepPipeline.swap_checkpoint>`)."""
        if self.action != "warn":
            self._pipeline.swap_checkpoint(trainer, checkpoint)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._series.at_end(trainer, self.events)
            self._progress.report(trainer, self.events, self.counters, self._events_path())
        self._close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn == "fit":
            self._series.at_end(trainer, self.events, type(exception).__name__)
            self._progress.report(trainer, self.events, self.counters, self._events_path(), type(exception).__name__)
        self._close()

    # ------------------------------------------------------------------ verbs

    def _events_path(self) -> Path | None:
        return self._reporter.events_path if self._reporter is not None else None

    def _close(self) -> None:
        self._pipeline.recorder.detach()
        self._pipeline.recovery.logged.release()
        if self._reporter is not None:
            self._reporter.close()


# LightningCLI's --help prints the Args: entries: plain text there, RST in the source.
NumGuardCallback.__doc__ = plain_args(NumGuardCallback.__doc__)
