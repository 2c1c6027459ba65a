"""``NumGuardCallback``: catch NaN/Inf on every training step, name the culprit, survive it.

The callback is an adapter: configuration, state and hooks of a few lines. The work is done by
collaborators with one job each (see ``ARCHITECTURE.md``):

* :class:`~lightning_numguard.callbacks._inspector.StepInspector`: the step record and its one read;
* :func:`~lightning_numguard.callbacks._diagnosis.diagnose`: the culprits of a hit, in causal order;
* :mod:`lightning_numguard.core.policy`: what to do about it;
* :class:`~lightning_numguard.callbacks._recovery.Recovery`: snapshots, skip, rollback, retry, halt;
* :class:`~lightning_numguard.callbacks._ledger.Ledger`: events and counters, handed to reporting.

The file is longer than the project's ~400-line guide only because of the class docstring: it is the
contract, the ``--help`` text of LightningCLI and the documentation of every argument.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from lightning_numguard import _compat
from lightning_numguard.callbacks import _config, _nofiles
from lightning_numguard.callbacks._amp import AmpCounters
from lightning_numguard.callbacks._config import CHECKS, DEFAULT_CHECKS, Action, Check
from lightning_numguard.callbacks._conventions import InputConventions
from lightning_numguard.callbacks._coverage import CoverageCheck
from lightning_numguard.callbacks._diagnosis import diagnose
from lightning_numguard.callbacks._inspector import StepInspector, StepRecord
from lightning_numguard.callbacks._ledger import Ledger
from lightning_numguard.callbacks._metrics import LoggedValues
from lightning_numguard.callbacks._progress import FitProgress
from lightning_numguard.callbacks._recovery import Recovery, stateful_objects
from lightning_numguard.callbacks._sharded import SHARDING
from lightning_numguard.callbacks._spike import STATEFUL_KEY, SpikeGuard
from lightning_numguard.callbacks._strategies import check_strategy
from lightning_numguard.callbacks._types import Backoff, NonNegativeInt, PositiveFloat, PositiveInt, plain_args
from lightning_numguard.callbacks._zerosync import SYNC_MODES, DeferredSync
from lightning_numguard.core import flags as slots
from lightning_numguard.core import policy
from lightning_numguard.core.findings import Finding
from lightning_numguard.core.quarantine import parse_state, position_key
from lightning_numguard.errors import NonFiniteError, NumGuardError
from lightning_numguard.reporting.report import Reporter, counter_scalars

__all__ = ["CHECKS", "DEFAULT_CHECKS", "NumGuardCallback"]

log = logging.getLogger(__name__)

_STATE_KEY = "NumGuardCallback"


class NumGuardCallback(Callback):
    r"""Check every training step for NaN/Inf, act before the damage lands, and say what went bad first.

    Each step it checks the batch's floating tensors, every watched block's output, the inputs
    of ops that device-assert on bad values, the loss, the gradients, and the parameters and
    buffers (and, optionally, the optimizer state) — all as device-side reductions packed into
    one flag vector that is all-reduced across ranks and read back **once** per optimizer step.
    Names, counts and indices are computed only after a hit.

    Args:
        action: what to do on an incident. ``"warn"``: record and report only. ``"skip"``: the
            optimizer step becomes a no-op (gradients set to ``None``) and buffers changed by the
            bad forward pass are restored; escalates to ``"rollback"`` when the weights or
            optimizer state are no longer finite. ``"rollback"``: restore the last
            verified-finite state in place and carry on; after ``max_rollbacks`` escalate to
            ``"halt"``. ``"halt"``: restore the last finite state, write
            ``<dirpath>/last_finite.ckpt``, stop every rank.
        dirpath: folder for ``events.jsonl``, ``last_finite.ckpt`` and ``bad_batches/``. Defaults
            to ``<trainer.log_dir>/numguard`` (``<default_root_dir>/numguard`` without a logger).
        check: which sites to check every step, any of ``inputs``, ``outputs``, ``ops``, ``loss``,
            ``grads``, ``buffers``, ``params``, ``optimizer_state``. ``outputs`` watches blocks (see
            ``watch_depth``): one fused min/max per block into a preallocated device buffer; after a
            hit the replay names the exact module and op inside the block. The default leaves out
            two whose work is repeated elsewhere: ``params`` (a NaN weight makes the outputs, loss
            and gradients non-finite, and after any hit the parameters are checked exactly and
            named first; they are also verified before every snapshot and checkpoint) and
            ``optimizer_state`` (verified before every snapshot; add it to catch a poisoned
            Adam moment before the step it would ruin).
        max_abs_input: finite batch values with ``|x|`` at or above this are ``suspicious_input``
            (numpy's masked-array fill value 1e20 and netCDF's 9.96921e36 are caught by the
            default; a value equal to its dtype's own finite extreme, ``torch.finfo(dtype).min`` in
            an additive attention mask, is a mask and does not count); ``None`` turns this off. A
            batch field flagged on 3 consecutive steps is taken for a convention of the data: said
            once, then no longer checked in the fit.
        watch_modules: glob patterns of module names whose outputs are watched.
        ignore_modules: glob patterns of module names not watched.
        watch_depth: which modules the ``outputs`` check watches: those at most this many levels
            below the LightningModule (``Sequential``/``ModuleList``/``ModuleDict`` do not count as
            a level), every element of a ``ModuleList``/``ModuleDict`` (repeated blocks; of a list
            of more than 16, every ``ceil(n / 16)``-th and the last), and any module an explicit
            ``watch_modules`` pattern names; ``None`` watches every module.
        check_optimizer_coverage: ``"warn"`` or ``"error"`` on trainable parameters in no optimizer,
            frozen parameters in one, parameters in two groups, trainable parameters that get no
            gradient; ``"off"`` to skip.
        snapshot_every_n_steps: take a verified-finite snapshot every this many clean steps.
        snapshot_device: keep snapshots on the ``"host"`` (pinned when CUDA is used) or on the
            ``"device"``.
        max_rollbacks: rollbacks allowed in one ``fit`` before escalating to ``"halt"``.
        skip_batches_after_rollback: batches to skip after each rollback (0 = only the bad one).
        lr_backoff: factor applied to every learning rate after each rollback (1.0 = unchanged).
        retry_transient: after a rollback, run the same batch once more from the restored state (under
            the precision plugin's autocast, stepping no optimizer and moving no counter) to judge the
            incident: if it comes out finite it was transient (``retry: transient`` in the event; the
            batch is not trained on and not quarantined), otherwise it is quarantined at once.
        quarantine: skip batch positions that failed twice (or failed a retry) in later epochs and
            after a resume, and save them under ``<dirpath>/bad_batches/``.
        replay: after an incident under ``skip``/``rollback``/``halt``, replay the batch with anomaly
            mode and backward hooks to name the first autograd op and module that went non-finite.
        emit_warnings: emit one ``NumGuardWarning`` per root cause's kind and place (its consequences in
            the same step are recorded, not warned; events, log lines and loggers are written either way).
        sync_mode: ``"every_step"`` reads the step's flags on the host before the optimizer step
            (one host read per step). ``"deferred"`` reads nothing on the step: a bad step is
            skipped on the device through the optimizer's ``found_inf`` (needs one fused optimizer,
            e.g. ``AdamW(..., fused=True)``, automatic optimization and no fp16 GradScaler;
            anything else raises ``NumGuardConfigError`` at fit start), its flags are copied to the
            host without blocking and read one step later, and a rollback or halt is decided then,
            from a snapshot verified before it is needed. Events keep the step of the fault and name
            the watched block and op call, not the leaf module inside the block; ``retry_transient``
            is refused and ``replay`` does not run (see ``docs/performance.md``).
        snapshot_sharding: ``"auto"`` shards snapshots under DDP with more than one rank (every rank
            holds the same weights and optimizer state): each rank keeps only its ``1/world`` of the
            parameters and optimizer states (buffers, schedulers, the scaler, metrics and RNG states
            stay whole and per rank), and a rollback, a halt, the end-of-fit repair and the checkpoint
            swap gather them back from every rank (one all-gather, only on those events). ``"off"``
            keeps a full copy on every rank; use it when the ranks do not hold the same parameters
            and optimizer state. Under ``ModelParallelStrategy`` (FSDP2, tensor parallel) the state is
            already sharded: each rank copies only its local shards, never re-sharded, restored in place with
            no collective. ``sync_mode="deferred"`` shards its ring of snapshots the same way.
        snapshot_async: take snapshots asynchronously: from the start of a step whose snapshot is due, the
            parameters and optimizer state are copied on a CUDA side stream (on the CPU: a worker thread),
            overlapped with the forward and backward passes, into a second snapshot buffer; the copy becomes
            the snapshot only once the step's read verified the state finite, and the optimizer step waits
            for it on the device (no host stall). Costs a second snapshot buffer while on (twice the
            snapshot's host memory). ``None`` (default): on when the LightningModule is on CUDA and
            ``snapshot_device="host"``, off on the CPU (a worker thread competes with compute on small
            machines); ``True`` forces it; ``sync_mode="deferred"`` keeps its own synchronous snapshots.
        spike_action: what to do when the loss or the global gradient norm is finite but far above its recent
            range (see ``docs/reference.md``, "Spikes"). ``None`` (default): the statistics are kept and logged,
            no event is recorded. ``"warn"``: record ``loss_spike`` / ``grad_norm_spike`` events. ``"skip"``:
            the step is skipped atomically like a non-finite one (in ``sync_mode="deferred"``: on the device,
            through ``found_inf``); the ``spike_rollback_after``-th spike within ``spike_window`` steps rolls
            back instead. ``"rollback"``: every spike rolls back to the last snapshot (with
            ``skip_batches_after_rollback`` and ``lr_backoff``). Needs ``action`` other than ``"warn"`` to act.
        spike_sigma: a value spikes when its cube root is more than this many robust standard deviations
            (the upper-half MAD, at least 5 % of the centre) above the median of the window's cube roots.
        spike_window: steps in the rolling window of the loss and the global gradient norm, kept on the device
            (0: no spike statistics, and the gradients are checked without computing their norm).
        spike_warmup: valid values the window needs before it judges; ``None``: ``spike_window // 2``.
        spike_rollback_after: under ``spike_action="skip"``, this many spikes within ``spike_window`` steps make
            the last one a rollback (0: never).
        overflow_headroom: a watched block whose output peak comes within this factor of its dtype's largest
            finite value (float16 65504; bfloat16 and float32 3.4e38) is reported once as ``overflow_risk``;
            ``None`` turns it off. A collapsing fp16 loss scale is reported as ``overflow_risk`` too.

    Raises:
        NumGuardConfigError: at construction, for any invalid argument.
        NonFiniteError: under ``"halt"`` when Lightning would not stop (``min_steps``/``min_epochs``
            not reached), after the last finite state was saved; and at fit start when the initial
            weights are not finite (except under ``"warn"``).

    Logged (TensorBoard tags; other loggers get the scalars):

    ==============================  =====================================================
    ``numguard/incidents``          incidents recorded so far (scalar; every ``log_every_n_steps``
                                    from step 0, and at each incident's step)
    ``numguard/skipped_steps``      optimizer steps turned into no-ops (scalar; the same steps)
    ``numguard/rollbacks``          rollbacks so far (scalar; the same steps)
    ``numguard/amp_overflow_steps`` steps the AMP GradScaler skipped itself (scalar; under a
                                    GradScaler also every ``log_every_n_steps``, with your metrics)
    ``numguard/loss_scale``         the GradScaler's loss scale (scalar, every ``log_every_n_steps``)
    ``numguard/events``             one markdown paragraph per incident (text)
    ``numguard/spikes``             loss and gradient-norm spikes so far (scalar, every
                                    ``log_every_n_steps``)
    ``numguard/grad_norm``          the global L2 norm of the gradients (scalar, every
                                    ``log_every_n_steps``; with spike statistics on)
    ``numguard/loss_zscore``        the loss's robust z-score against the window (scalar,
                                    every ``log_every_n_steps``, after the warm-up)
    ``numguard/grad_norm_zscore``   the gradient norm's z-score, likewise
    ==============================  =====================================================

    Across ranks: input, output, op and loss flags are local and carry the rank into the one
    all-reduce, so every rank takes the same decision in the same step; files and loggers are
    written by global rank 0; ``trainer.save_checkpoint`` is called on every rank.

    Example::

        from pytorch_lightning import Trainer
        from lightning_numguard import NumGuardCallback

        trainer = Trainer(callbacks=[NumGuardCallback(action="rollback", lr_backoff=0.5)])
    """

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
        spike_sigma: PositiveFloat = 6.0,
        spike_window: NonNegativeInt = 128,
        spike_warmup: PositiveInt | None = None,
        spike_rollback_after: NonNegativeInt = 3,
        overflow_headroom: PositiveFloat | None = 8.0,
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
        _config.flag("emit_warnings", emit_warnings)
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
        """New collaborators for a fit (run in ``setup``, before Lightning loads this callback's state)."""
        self._inspector = self._new_inspector()
        self._conventions = InputConventions()  # batch fields flagged step after step: no longer checked
        self._inspector.ignored_inputs = self._conventions.ignored
        self._reporter = Reporter(dirpath, warn=self.emit_warnings)
        self._ledger = Ledger(self._reporter)
        self._recovery = Recovery(
            dirpath,
            self.snapshot_device,
            self.skip_batches_after_rollback,
            self.lr_backoff,
            self.retry_transient,
            self.quarantine,
            self.snapshot_sharding,  # the deferred ring shards the same way (callbacks/_zerosync.py)
            self.snapshot_async if self.sync_mode == "every_step" else False,  # deferred keeps its own ring
        )
        self._coverage = CoverageCheck(self.check_optimizer_coverage)
        self._progress = FitProgress()
        self._logged = LoggedValues()
        self._amp = AmpCounters()
        self._deferred = DeferredSync() if self.sync_mode == "deferred" else None
        self._spike = SpikeGuard(
            self.spike_action,
            self.spike_sigma,
            self.spike_window,
            self.spike_warmup,
            self.spike_rollback_after,
            self.overflow_headroom,
        )
        self._inspector.spike = self._spike

    def _new_inspector(self) -> StepInspector:
        return StepInspector(self.check, self.max_abs_input, self.watch_modules, self.ignore_modules, self.watch_depth)

    # ------------------------------------------------------------------ public state

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event recorded so far in this fit (the same content as ``events.jsonl``)."""
        return self._ledger.events

    @property
    def counters(self) -> dict[str, int]:
        """``incidents``, ``skipped_steps``, ``rollbacks`` and ``amp_overflow_steps`` so far."""
        return self._ledger.counters

    @property
    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantined batches (epoch, batch_idx, step, reason, sample_indices, file)."""
        return self._recovery.quarantine.entries

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
            "version": 1,
            "counters": dict(self.counters),
            "incidents_by_kind": dict(self._ledger.incidents_by_kind),
            **self._recovery.quarantine.state_dict(),
            "spike": self._spike.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters, the quarantine and incident counts; nothing is changed if any part is malformed."""
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
            self._spike.load_state_dict(dict(state_dict.get("spike") or {}))
        except (AttributeError, TypeError, ValueError, KeyError) as err:
            raise NumGuardError(
                f"NumGuard: the callback state in this checkpoint is malformed at 'spike' ({err}); the checkpoint's "
                "weights are unaffected: resume without this callback's state, or from another checkpoint."
            ) from None
        self.counters.update(parsed["counters"])
        self._ledger.incidents_by_kind = parsed["incidents_by_kind"]
        self._recovery.quarantine.load_state_dict(parsed)

    def __getstate__(self) -> dict[str, Any]:
        # Hooks, the op-guard mode and the step record belong to a running fit; setup rebuilds them.
        state = self.__dict__.copy()
        state["_inspector"] = self._new_inspector()
        return state

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._inspector.detach()
        _compat.require_accumulation_api(trainer)
        check_strategy(trainer.strategy, self.action)
        root = Path(trainer.log_dir or trainer.default_root_dir)
        dirpath = Path(self.dirpath) if self.dirpath else root / "numguard"
        self._fresh_run(dirpath if _nofiles.writes_files(trainer, self.dirpath) else None)  # None: no files
        self._inspector.attach(pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recovery.stateful = stateful_objects(trainer, pl_module)
        if self._spike.window is not None:  # snapshots hold the spike window: a rollback puts it back
            self._recovery.stateful[STATEFUL_KEY] = self._spike.window
        self._inspector.resolve(pl_module, self._recovery.stateful)
        self._coverage.at_fit_start(trainer, pl_module, self._ledger)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning restored optimizers, schedulers and the scaler from a checkpoint (it does so after
        # on_fit_start): a snapshot taken earlier would roll a resumed run back to fresh optimizers.
        bad = self._recovery.at_train_start(trainer, pl_module, self._inspector, self.action != "warn")
        # the fused check writes the same bits back: only while no snapshot is copied on another thread
        self._inspector.state_rewritable = not self._recovery.async_on
        if bad:
            self._halt_at_fit_start(trainer, bad)
        if self._deferred is not None:
            self._deferred.at_fit_start(self, trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        new_step = self._inspector.record is None
        stateful = self._recovery.stateful
        rec = self._inspector.begin(trainer, pl_module, batch, batch_idx, self.action != "warn", stateful)
        self._recovery.flag_batch(rec, batch, batch_idx, trainer.global_step, new_step)
        if new_step and self._recovery.async_on:  # start the due snapshot's copies, overlapped with the step
            due = policy.snapshot_due(
                self.action, trainer.global_step, self._recovery.last_snapshot_step, self.snapshot_every_n_steps
            )
            self._recovery.start_snapshot(trainer, pl_module, due)
        if new_step and self.action != "warn":
            self._logged.mark(trainer)
        self._inspector.enter_ops()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._inspector.exit_ops()
        self._inspector.record_loss(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._inspector.exit_ops()
        rec = self._inspector.record
        if rec is None:  # an optimizer step outside a training batch (manual loops)
            return
        if rec.read_done and rec.bad:  # a further optimizer of a bad batch (manual optimization)
            optimizer.zero_grad(set_to_none=True)
            return
        if rec.read_done:  # a further optimizer of a clean batch: its gradients only
            self._inspector.forget_forward()
        if self._deferred is not None:
            self._deferred.before_step(self, trainer, pl_module, optimizer)
            return
        self._read(trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._inspector.exit_ops()
        rec = self._inspector.record
        if rec is None:
            return
        if self._deferred is not None:
            self._deferred.after_step()
        if not rec.read_done:
            if _compat.should_accumulate(trainer):
                return  # the window's records are read at its optimizer step
            self._read(trainer, pl_module, None)
        self._inspector.end()
        self._spike.push()  # before the action: a rollback puts back the window of its snapshot
        self._finish(trainer, pl_module, rec)
        self._progress.after_step(trainer, pl_module, rec, self._recovery.snapshot, self.counters)
        self._amp.log(trainer, pl_module, self.counters["amp_overflow_steps"])
        # host numbers: the counters and the spike statistics of the step's one read, no device read
        self._reporter.series(trainer, rec.step, {**counter_scalars(self.counters), **self._spike.scalars()})

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deferred is not None:
            self._deferred.at_train_end(self, trainer, pl_module)
        # The last step's update has not been checked yet: check it once (one sync per fit).
        end = self._recovery.at_train_end(trainer, pl_module, self._inspector, self.action == "warn")
        if end is not None:
            bad, action, details = end
            self.counters["rollbacks"] += action == "rollback"  # the repair restored from the snapshot: counted
            finding = Finding("nonfinite_param", bad, details, self._recovery.bad_rank)
            self._ledger.record(trainer, [self._ledger.event(trainer, finding, trainer.global_step, action)])

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Last line of defence: no checkpoint written during the run holds non-finite weights.

        Runs for every checkpoint any callback saves (``ModelCheckpoint``, ``OnExceptionCheckpoint``,
        ``trainer.save_checkpoint``), on every rank. A weight or optimizer state that went non-finite
        in the optimizer step itself is only seen at the next step's read; if a checkpoint is written
        in between, its model and optimizer states are replaced by the last verified-finite snapshot.
        """
        if self.action == "warn" or not self._recovery.swap_checkpoint(
            trainer, checkpoint, self._inspector.unchecked_buffers
        ):
            return
        assert self._recovery.snapshot is not None
        details = {"when": "while saving a checkpoint", "snapshot_step": self._recovery.snapshot.step}
        finding = Finding("nonfinite_param", ["checkpoint"], details, self._recovery.bad_rank)
        self._ledger.record(trainer, [self._ledger.event(trainer, finding, trainer.global_step, "none")])

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._progress.report(trainer, self.events, self.counters, self._events_path())
        self._close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn == "fit":
            self._progress.report(trainer, self.events, self.counters, self._events_path(), type(exception).__name__)
        self._close()

    # ------------------------------------------------------------------ verbs

    def _events_path(self) -> Path | None:
        return self._reporter.events_path if self._reporter is not None else None

    def _close(self) -> None:
        self._inspector.detach()
        self._logged.release()
        if self._reporter is not None:
            self._reporter.close()

    def _read(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """The step's one read; on a hit, the culprits and the decision (the action itself waits for batch end)."""
        rec = self._inspector.record
        assert rec is not None
        if optimizer is not None and rec.forced_skip is None:
            self._coverage.at_first_step(trainer, pl_module, optimizer, self._ledger)
        due = policy.snapshot_due(
            self.action, trainer.global_step, self._recovery.last_snapshot_step, self.snapshot_every_n_steps
        )
        reading = self._inspector.read(trainer, pl_module, optimizer, due)
        spikes = self._spike_findings(trainer, rec, reading.extras)
        if reading.flags.seen(slots.QUARANTINE) and rec.forced_skip is None:
            rec.forced_skip = "it holds samples quarantined after they failed before"
        if rec.forced_skip is not None:
            self._skip_quietly(trainer, pl_module, optimizer, rec, reading)
        elif reading.flags.any:
            self._on_hit(trainer, pl_module, optimizer, rec, reading, due)
        else:
            self._conventions.clean_step()
            if spikes:
                self._on_spike(trainer, optimizer, rec, spikes)
            elif due:
                self._recovery.take(trainer, pl_module, rec)
        self._recovery.settle()

    def _skip_quietly(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, rec: StepRecord, reading: Any
    ) -> None:
        """A batch known to be bad (quarantined) or in the window after a rollback: skip it without an incident."""
        rec.bad, rec.action = True, self._decide(state_bad=False, has_incident=False)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        self.counters["skipped_steps"] += 1
        if not self._inspector.state_bad(trainer, reading):
            self._recovery.take(trainer, pl_module, rec)  # the state before this batch is verified finite
        log.info("numguard skipped batch %s at step %s: %s", rec.batch_idx, rec.step, rec.forced_skip)

    def _on_hit(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        rec: StepRecord,
        reading: Any,
        due: bool,
    ) -> None:
        self._inspector.point_to_bad_micro_batch(trainer)  # under accumulation: the micro-batch that went bad
        found = diagnose(trainer, pl_module, self._inspector, reading, self.replay and self.action != "warn")
        if found.amp_overflow:
            self.counters["amp_overflow_steps"] += 1
            collapsed = self._amp.after_overflow(trainer)
            risk = self._spike.loss_scale_finding(collapsed) if collapsed is not None else None
            if risk is not None:  # reported like a block near its dtype's limit (one event, one warning)
                self._ledger.record(trainer, [self._ledger.event(trainer, risk, rec.step, "none")])
        findings, declared = self._conventions.sort(found.findings)  # a field flagged step after step: not a fault
        conventions = self._conventions_declared(trainer, declared, rec.step, rec.epoch, rec.batch_idx)
        if not findings:
            rec.events = conventions
            if due:
                self._recovery.take(trainer, pl_module, rec)
            return
        rec.action = self._decide(state_bad=bool(found.state_bad), has_incident=True)
        rec.bad = rec.action != "warn"
        if rec.bad:
            if optimizer is not None:  # the step becomes a no-op: no momentum, weight decay or step count moves
                optimizer.zero_grad(set_to_none=True)
            self.counters["skipped_steps"] += 1
            if not found.state_bad:  # the state before this step is verified finite: a rollback undoes exactly it
                self._recovery.take(trainer, pl_module, rec)
        rec.events = conventions + [
            self._ledger.event(trainer, f, rec.step, rec.action, rec.epoch, rec.batch_idx) for f in findings
        ]
        self._recovery.quarantine.count_failure(position_key(rec.batch, rec.batch_idx))

    def _spike_findings(self, trainer: pl.Trainer, rec: StepRecord, extras: list[float]) -> list[Finding]:
        """The step's spikes (acted on by the caller) from the read's extras; its overflow risks recorded now."""
        if not extras:
            return []
        spikes, risks = self._spike.findings(extras, rec.step, self._inspector.watch, trainer.world_size)
        if risks:
            self._ledger.record(trainer, [self._ledger.event(trainer, f, rec.step, "none") for f in risks])
        return spikes

    def _on_spike(self, trainer: pl.Trainer, optimizer: Any, rec: StepRecord, spikes: list[Finding]) -> None:
        """A finite spike: skipped atomically like a non-finite step, rolled back, or only recorded."""
        wanted = self._spike.decide(rec.step)
        self.counters["spikes"] += 1
        rec.action = policy.decide(
            wanted,
            state_bad=False,
            has_incident=True,
            have_snapshot=self._recovery.snapshot is not None,
            rollbacks_used=self._recovery.rollbacks_this_fit,
            max_rollbacks=self.max_rollbacks,
        )
        rec.bad = rec.action != "warn"
        if rec.bad:
            if optimizer is not None:  # the same no-op step as for a non-finite one
                optimizer.zero_grad(set_to_none=True)
            self.counters["skipped_steps"] += 1
        for f in spikes:
            if wanted != self.spike_action:
                f.details["escalated"] = f"{self.spike_rollback_after} spikes within {self.spike_window} steps"
        rec.events = [self._ledger.event(trainer, f, rec.step, rec.action, rec.epoch, rec.batch_idx) for f in spikes]

    def _conventions_declared(
        self, trainer: pl.Trainer, declared: list[Finding], step: int, epoch: int | None, batch_idx: int
    ) -> list[dict[str, Any]]:
        """The events (action ``"none"``) of batch fields declared conventions at this step, each said once."""
        events = [self._ledger.event(trainer, f, step, "none", epoch, batch_idx) for f in declared]
        for event in events:
            self._reporter.say_once(trainer, f"convention {event['where']}", event["message"])
        return events

    def _decide(self, state_bad: bool, has_incident: bool) -> str:
        return policy.decide(
            self.action,
            state_bad=state_bad,
            has_incident=has_incident,
            have_snapshot=self._recovery.snapshot is not None,
            rollbacks_used=self._recovery.rollbacks_this_fit,
            max_rollbacks=self.max_rollbacks,
        )

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: StepRecord) -> None:
        """Carry out the step's action at batch end, then record its events."""
        if rec.bad:  # what the discarded step logged must not reach monitors, schedulers or loggers
            self._logged.discard(trainer)
        if rec.action == "skip":
            self._recovery.undo_forward(pl_module, rec)
        elif rec.action == "rollback":
            self.counters["rollbacks"] += bool(rec.events)  # counted before last_finite.ckpt is written
            self._recovery.rollback(trainer, pl_module, rec)
        elif rec.action == "halt":  # the incident is counted in the guard's state that last_finite.ckpt holds
            self._ledger.record(trainer, rec.events)
            self._recovery.halt(trainer, pl_module)
        if rec.action != "halt":
            self._ledger.record(trainer, rec.events)
        spiked = bool(rec.events) and rec.events[0]["kind"] in ("loss_spike", "grad_norm_spike")
        # a spike's action is spike_action's, escalated by repeated spikes (said in the event) or to a halt
        configured = (rec.action if rec.action != "halt" else "rollback") if spiked else self.action
        self._ledger.log_action(trainer, rec, configured, self._recovery)
        if rec.action == "halt" and trainer.should_stop and not _compat.lightning_will_stop(trainer):
            ckpt = self._recovery.ckpt_path
            where = f"is in {ckpt}" if ckpt is not None else "was restored in memory (no file is written in this run)"
            raise NonFiniteError(
                f"NumGuard halted training at step {rec.step}: "
                + next((e["message"] for e in rec.events if e["action"] == "halt"), "non-finite values")
                + f". The last finite state {where}."
            )

    def _halt_at_fit_start(self, trainer: pl.Trainer, bad: list[str]) -> None:
        finding = Finding("nonfinite_param", bad, {"when": "fit start"})
        self._ledger.record(trainer, [self._ledger.event(trainer, finding, 0, "none")])
        if self.action != "warn":
            raise NonFiniteError(
                f"NumGuard: the weights or optimizer state are already non-finite at fit start ({bad[:3]}); "
                "there is no finite state to protect. Resume from an earlier checkpoint."
            )


# LightningCLI's --help prints the Args: entries: plain text there, RST in the source.
NumGuardCallback.__doc__ = plain_args(NumGuardCallback.__doc__)
