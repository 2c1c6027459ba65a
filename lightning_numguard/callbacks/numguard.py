"""``NumGuardCallback``: catch NaN/Inf on every training step, name the culprit, survive it."""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from lightning_numguard.callbacks._state import (
    apply_lr_backoff,
    clone_states,
    stateful_objects,
)
from lightning_numguard.core import checks
from lightning_numguard.core.coverage import check_coverage, never_got_grad
from lightning_numguard.core.events import KINDS, Event
from lightning_numguard.core.opguard import OpGuard
from lightning_numguard.core.snapshot import Snapshot, capture, clone_tree, restore, rng_state, set_rng_state
from lightning_numguard.core.tree import floating_leaves
from lightning_numguard.core.watch import OutputWatch
from lightning_numguard.errors import NonFiniteError, NumGuardConfigError, NumGuardError
from lightning_numguard.reporting.messages import incident_message
from lightning_numguard.reporting.report import Reporter

__all__ = ["NumGuardCallback"]

log = logging.getLogger(__name__)

Action = Literal["warn", "skip", "rollback", "halt"]
Check = Literal["inputs", "outputs", "ops", "loss", "grads", "buffers", "params", "optimizer_state"]
CHECKS: tuple[str, ...] = get_args(Check)
DEFAULT_CHECKS: tuple[str, ...] = ("inputs", "ops", "loss", "grads", "buffers")

# Slots of the one packed flag vector read per step, in causal order.
# _NORMS covers parameters, buffers, optimizer state and gradients: which of them is confirmed after a hit.
_INPUT, _NORMS, _OUTPUT, _LOSS, _SUSPICIOUS, _OP, _QUARANTINE = range(7)


@dataclass
class _Step:
    """What one optimizer step (one accumulation window) has recorded so far, on the device."""

    epoch: int
    batch_idx: int
    batch: Any = None
    # per micro-batch: the floating leaves of the batch and their max-|x| (0-d, NaN propagates)
    inputs: list[tuple[list[tuple[str, torch.Tensor]], torch.Tensor]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    start_buffers: dict[str, torch.Tensor] | None = None
    start_states: dict[str, Any] | None = None
    start_rng: dict[str, Any] | None = None
    forced_skip: str | None = None
    quarantine_flag: torch.Tensor | None = None
    read_done: bool = False
    bad: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    action: str = "none"
    step: int = 0


class NumGuardCallback(Callback):
    r"""Check every training step for NaN/Inf, act before the damage lands, and say what went bad first.

    Each step it checks the batch's floating tensors, (optionally) every watched module's output, the inputs
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
            ``grads``, ``buffers``, ``params``, ``optimizer_state``. The default leaves out three
            whose work is repeated elsewhere: ``outputs`` (a forward hook on every module; after a
            hit the replay names the first module instead — add it to name modules under
            ``"warn"`` or with ``replay=False``), ``params`` (a NaN weight makes the outputs, loss
            and gradients non-finite, and after any hit the parameters are checked exactly and
            named first; they are also verified before every snapshot and checkpoint) and
            ``optimizer_state`` (verified before every snapshot; add it to catch a poisoned
            Adam moment before the step it would ruin).
        max_abs_input: finite batch values with ``|x|`` at or above this are ``suspicious_input``
            (numpy's masked-array fill value 1e20 and netCDF's 9.96921e36 are caught by the
            default); ``None`` turns this off.
        watch_modules: glob patterns of module names whose outputs are watched.
        ignore_modules: glob patterns of module names not watched.
        check_optimizer_coverage: ``"warn"`` or ``"error"`` on trainable parameters in no optimizer,
            frozen parameters in one, parameters in two groups, trainable parameters that get no
            gradient; ``"off"`` to skip.
        snapshot_every_n_steps: take a verified-finite snapshot every this many clean steps.
        snapshot_device: keep snapshots on the ``"host"`` (pinned when CUDA is used) or on the
            ``"device"``.
        max_rollbacks: rollbacks allowed in one ``fit`` before escalating to ``"halt"``.
        skip_batches_after_rollback: batches to skip after each rollback (0 = only the bad one).
        lr_backoff: factor applied to every learning rate after each rollback (1.0 = unchanged).
        retry_transient: after a rollback, run the same batch once more from the restored state; if
            it comes out finite the incident was transient and the batch is trained on, otherwise
            it is quarantined at once.
        quarantine: skip batch positions that failed twice (or failed a retry) in later epochs and
            after a resume, and save them under ``<dirpath>/bad_batches/``.
        replay: after an incident under ``skip``/``rollback``/``halt``, replay the batch with anomaly
            mode and backward hooks to name the first autograd op and module that went non-finite.
        warn: emit one ``NumGuardWarning`` per incident kind and place.

    Raises:
        NumGuardConfigError: at construction, for any invalid argument.
        NonFiniteError: under ``"halt"`` when Lightning would not stop (``min_steps``/``min_epochs``
            not reached), after the last finite state was saved; and at fit start when the initial
            weights are not finite (except under ``"warn"``).

    Logged (TensorBoard tags; other loggers get the scalars):

    ==============================  =====================================================
    ``numguard/incidents``          incidents recorded so far (scalar)
    ``numguard/skipped_steps``      optimizer steps turned into no-ops (scalar)
    ``numguard/rollbacks``          rollbacks so far (scalar)
    ``numguard/amp_overflow_steps`` steps the AMP GradScaler skipped itself (scalar)
    ``numguard/events``             one markdown paragraph per incident (text)
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
        check: list[str] = list(DEFAULT_CHECKS),  # noqa: B006 - shown as the default in --help
        max_abs_input: float | None = 1e18,
        watch_modules: list[str] = ["*"],  # noqa: B006
        ignore_modules: list[str] = [],  # noqa: B006
        check_optimizer_coverage: Literal["off", "warn", "error"] = "warn",
        snapshot_every_n_steps: int = 50,
        snapshot_device: Literal["host", "device"] = "host",
        max_rollbacks: int = 10,
        skip_batches_after_rollback: int = 0,
        lr_backoff: float = 1.0,
        retry_transient: bool = False,
        quarantine: bool = True,
        replay: bool = True,
        warn: bool = True,
    ) -> None:
        super().__init__()
        _choice("action", action, get_args(Action))
        _choice("check_optimizer_coverage", check_optimizer_coverage, ("off", "warn", "error"))
        _choice("snapshot_device", snapshot_device, ("host", "device"))
        if isinstance(check, str) or not all(isinstance(c, str) for c in check):
            raise NumGuardConfigError(f"`check` must be a list of strings from {list(CHECKS)}, got {check!r}")
        for c in check:
            _choice("check", c, CHECKS)
        for name, patterns in (("watch_modules", watch_modules), ("ignore_modules", ignore_modules)):
            if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
                raise NumGuardConfigError(
                    f"`{name}` must be a list of glob patterns such as ['encoder.*'], got {patterns!r}"
                )
        if max_abs_input is not None and (
            isinstance(max_abs_input, bool) or not isinstance(max_abs_input, (int, float)) or not max_abs_input > 0
        ):
            raise NumGuardConfigError(f"`max_abs_input` must be a positive number or None, got {max_abs_input!r}")
        _int("snapshot_every_n_steps", snapshot_every_n_steps, 1)
        _int("max_rollbacks", max_rollbacks, 0)
        _int("skip_batches_after_rollback", skip_batches_after_rollback, 0)
        if (
            isinstance(lr_backoff, bool)
            or not isinstance(lr_backoff, (int, float))
            or not 0 < lr_backoff <= 1
            or not math.isfinite(lr_backoff)
        ):
            raise NumGuardConfigError(f"`lr_backoff` must be a number in (0, 1], got {lr_backoff!r}")
        for name, flag in (
            ("retry_transient", retry_transient),
            ("quarantine", quarantine),
            ("replay", replay),
            ("warn", warn),
        ):
            if not isinstance(flag, bool):
                raise NumGuardConfigError(f"`{name}` must be True or False, got {flag!r}")
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise NumGuardConfigError(f"`dirpath` must be a path or None, got {dirpath!r}")

        self.action = action
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.check = list(dict.fromkeys(check))
        self.max_abs_input = float(max_abs_input) if max_abs_input is not None else None
        self.watch_modules = list(watch_modules)
        self.ignore_modules = list(ignore_modules)
        self.check_optimizer_coverage = check_optimizer_coverage
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.snapshot_device = snapshot_device
        self.max_rollbacks = max_rollbacks
        self.skip_batches_after_rollback = skip_batches_after_rollback
        self.lr_backoff = float(lr_backoff)
        self.retry_transient = retry_transient
        self.quarantine = quarantine
        self.replay = replay
        self.warn = warn

        self._reset_run_state()

    # ------------------------------------------------------------------ state

    def _reset_run_state(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.counters: dict[str, int] = {
            "incidents": 0,
            "skipped_steps": 0,
            "rollbacks": 0,
            "amp_overflow_steps": 0,
        }
        self.quarantined: list[dict[str, Any]] = []
        self.position_incidents: dict[str, int] = {}
        self.incidents_by_kind: dict[str, int] = {}
        self._watch: OutputWatch | None = None
        self._opguard: OpGuard | None = None
        self._opguard_entered = False
        self._reporter: Reporter | None = None
        self._snapshot: Snapshot | None = None
        self._last_snapshot_step = -(10**9)
        self._step_rec: _Step | None = None
        self._skip_remaining = 0
        self._coverage_grad_checked = False
        self._stateful: dict[str, Any] = {}
        self._named_params: list[tuple[str, torch.Tensor]] = []
        self._named_buffers: list[tuple[str, torch.Tensor]] = []
        self._param_names: dict[int, str] = {}
        self._start_buffers: list[torch.Tensor] = []
        self._start_buffer_map: dict[str, torch.Tensor] = {}
        self._metric_keys: list[str] = []
        self._unchecked_buffers: set[str] = set()
        self._checked_buffers: list[tuple[str, torch.Tensor]] = []
        self._module_names: dict[int, str] = {}
        self._quarantine_known: tuple[int, torch.Tensor] | None = None
        self._rollbacks_this_fit = 0

    @property
    def resolved_dirpath(self) -> Path | None:
        """The folder events and checkpoints are written to (known from ``setup`` on)."""
        return self._reporter.dirpath if self._reporter is not None else None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "counters": dict(self.counters),
            "quarantined": [dict(q) for q in self.quarantined],
            "position_incidents": dict(self.position_incidents),
            "incidents_by_kind": dict(self.incidents_by_kind),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters, the quarantine and incident counts; nothing is changed if any part is malformed."""
        key = "state"
        try:
            key = "counters"
            counters = {str(k): int(v) for k, v in state_dict.get("counters", {}).items()}
            key = "quarantined"
            quarantined = [dict(q) for q in state_dict.get("quarantined", [])]
            if any(not isinstance(q.get("batch_idx"), int) for q in quarantined):
                raise TypeError("every entry needs an integer 'batch_idx'")
            key = "position_incidents"
            positions = {str(k): int(v) for k, v in state_dict.get("position_incidents", {}).items()}
            key = "incidents_by_kind"
            by_kind = {str(k): int(v) for k, v in state_dict.get("incidents_by_kind", {}).items()}
        except (AttributeError, TypeError, ValueError) as err:
            raise NumGuardError(
                f"NumGuard: the callback state in this checkpoint is malformed at {key!r} ({err}); the "
                "checkpoint's weights are unaffected: resume without this callback's state by removing "
                "checkpoint['callbacks'] entries for NumGuardCallback, or from another checkpoint."
            ) from None
        self.counters.update(counters)
        self.quarantined = quarantined
        self.position_incidents = positions
        self.incidents_by_kind = by_kind

    def __getstate__(self) -> dict[str, Any]:
        # Hooks, the op-guard mode and the step record belong to a running fit; setup rebuilds them.
        state = self.__dict__.copy()
        for name in ("_watch", "_opguard", "_step_rec"):
            state[name] = None
        state["_opguard_entered"] = False
        return state

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._teardown_hooks()
        self._reset_run_state()
        dirpath = Path(self.dirpath) if self.dirpath else Path(trainer.log_dir or trainer.default_root_dir) / "numguard"
        self._reporter = Reporter(dirpath, warn=self.warn)
        if "ops" in self.check:
            self._opguard = OpGuard()
            self._opguard.enabled = False
            self._opguard.module_resolver = self._calling_module
        if "outputs" in self.check:
            self._watch = OutputWatch(pl_module, self.watch_modules, self.ignore_modules)
            self._watch.attach()
        self._module_names = {id(m): n for n, m in pl_module.named_modules()}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stateful = stateful_objects(trainer, pl_module)
        # Resolved once per fit: the hot path must not walk the module tree every step.
        self._named_params = list(pl_module.named_parameters())
        self._param_names = {id(p): n for n, p in self._named_params}
        persistent = set(pl_module.state_dict())
        self._named_buffers = [(n, b) for n, b in pl_module.named_buffers() if n in persistent]
        self._start_buffers = [b.detach().clone() for _, b in self._named_buffers]
        self._start_buffer_map = {n: c for (n, _), c in zip(self._named_buffers, self._start_buffers)}
        self._metric_keys = [k for k in self._stateful if k.startswith("metric:")]
        if self.check_optimizer_coverage != "off":
            self._coverage(trainer, pl_module)
        tensors, names = self._state_tensors(trainer, pl_module, with_optimizer=True)
        bad = [n for n, b in zip(names, checks.confirm_nonfinite(tensors)) if b]  # one sync per fit
        bad = _any_rank(trainer, bad)
        # Buffers that are non-finite by design (a float causal mask of 0/-inf) are not state gone bad:
        # they are restored with the rest but never checked.
        buffer_names = {n for n, _ in self._named_buffers}
        self._unchecked_buffers = {n for n in bad if n in buffer_names}
        if self._unchecked_buffers:
            log.info("numguard leaves buffers non-finite at fit start unchecked: %s", sorted(self._unchecked_buffers))
        bad = [n for n in bad if n not in self._unchecked_buffers]
        self._checked_buffers = [
            (n, b) for n, b in self._named_buffers if n not in self._unchecked_buffers and b.is_floating_point()
        ]
        if bad:
            self._record(trainer, [self._event(trainer, "nonfinite_param", bad, {"when": "fit start"}, 0, "none")])
            if self.action != "warn":
                raise NonFiniteError(
                    f"NumGuard: the weights or optimizer state are already non-finite at fit start ({bad[:3]}); "
                    "there is no finite state to protect. Resume from an earlier checkpoint."
                )
            return
        if self.action != "warn":
            self._snapshot = capture(
                pl_module,
                trainer.optimizers,
                self._stateful,
                step=trainer.global_step,
                where=self.snapshot_device,
            )
            self._last_snapshot_step = trainer.global_step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        rec = self._step_rec
        if rec is None:
            rec = self._step_rec = _Step(epoch=trainer.current_epoch, batch_idx=batch_idx, batch=batch)
            if self.action != "warn":
                if self._start_buffers:  # one fused copy of every buffer, into storage reused each step
                    torch._foreach_copy_(self._start_buffers, [b for _, b in self._named_buffers])
                rec.start_buffers = self._start_buffer_map  # storage reused every step
                # numpy's RNG is left to the snapshot: reading its state costs ~0.1 ms, more than all the rest
                rec.start_states = clone_states(self._stateful, self._metric_keys)
                rec.start_rng = rng_state()
            if self._skip_remaining > 0:
                self._skip_remaining -= 1
                rec.forced_skip = "in the skip window after a rollback"
            elif self.quarantine and self.quarantined:
                rec.quarantine_flag = self._quarantine_flag(batch, batch_idx, trainer.global_step)
        if "inputs" in self.check:
            leaves = floating_leaves(batch)
            if leaves:
                rec.inputs.append((leaves, checks.max_abs_total([t for _, t in leaves], pl_module.device)))
        if self._opguard is not None:
            self._opguard.enabled = True
            if not self._opguard_entered:
                self._opguard.__enter__()
                self._opguard_entered = True

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._exit_opguard()
        if "loss" in self.check and self._step_rec is not None:
            self._step_rec.losses.append(loss.detach())

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._exit_opguard()
        rec = self._step_rec
        if rec is None:  # an optimizer step outside a training batch (manual loops)
            return
        if rec.read_done:  # a further optimizer of the same batch (manual optimization)
            if rec.bad:
                optimizer.zero_grad(set_to_none=True)
                return
            self._read(trainer, pl_module, optimizer, grads_only=True)
            return
        self._read(trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._exit_opguard()
        rec = self._step_rec
        if rec is None:
            return
        if not rec.read_done:
            if _accumulating(trainer):
                return  # the window's records are read at its optimizer step
            self._read(trainer, pl_module, None)
        self._step_rec = None
        try:
            self._finish(trainer, pl_module, rec)
        finally:
            if self._watch is not None:
                self._watch.reset()
            if self._opguard is not None:
                self._opguard.reset()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last step's update has not been checked yet: check it once (one sync per fit).
        tensors, names = self._state_tensors(trainer, pl_module, with_optimizer=False)
        bad = _any_rank(trainer, [n for n, b in zip(names, checks.confirm_nonfinite(tensors)) if b])
        if bad:
            action = "none" if self.action == "warn" or self._snapshot is None else "rollback"
            if action == "rollback" and self._snapshot is not None:
                restore(self._snapshot, pl_module, trainer.optimizers, self._stateful, restore_rng=False)
            self._record(
                trainer,
                [
                    self._event(
                        trainer,
                        "nonfinite_param",
                        bad,
                        {"when": "end of training"},
                        trainer.global_step,
                        action,
                    )
                ],
            )

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Last line of defence: no checkpoint written during the run holds non-finite weights.

        Runs for every checkpoint any callback saves (``ModelCheckpoint``, ``OnExceptionCheckpoint``,
        ``trainer.save_checkpoint``), on every rank. A weight or optimizer state that went non-finite
        in the optimizer step itself is only seen at the next step's read; if a checkpoint is written
        in between, its model and optimizer states are replaced by the last verified-finite snapshot.
        Costs one sync per checkpoint, nothing per step.
        """
        if self.action == "warn" or self._snapshot is None:
            return
        model_state = {k: v for k, v in checkpoint.get("state_dict", {}).items() if k not in self._unchecked_buffers}
        tensors = list(_tensors(model_state)) + list(_tensors(checkpoint.get("optimizer_states", [])))
        if not tensors or not any(_any_rank(trainer, ["bad"] if any(checks.confirm_nonfinite(tensors)) else [])):
            return
        checkpoint["state_dict"] = clone_tree(self._snapshot.model, "cpu")
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = clone_tree(self._snapshot.optimizers, "cpu")
        self._record(
            trainer,
            [
                self._event(
                    trainer,
                    "nonfinite_param",
                    ["checkpoint"],
                    {"when": "while saving a checkpoint", "snapshot_step": self._snapshot.step},
                    trainer.global_step,
                    "none",
                )
            ],
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._teardown_hooks()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._teardown_hooks()

    # ------------------------------------------------------------------ verbs

    def _teardown_hooks(self) -> None:
        self._exit_opguard()
        if getattr(self, "_watch", None) is not None:
            self._watch.detach()  # type: ignore[union-attr]
        if getattr(self, "_reporter", None) is not None:
            self._reporter.close()  # type: ignore[union-attr]

    def _exit_opguard(self) -> None:
        guard = getattr(self, "_opguard", None)
        if guard is None:
            return
        guard.enabled = False
        if self._opguard_entered:
            self._opguard_entered = False
            try:
                guard.__exit__(None, None, None)
            except Exception:  # the mode stack was changed under us; nothing left to undo
                log.debug("numguard op guard was not on top of the mode stack", exc_info=True)

    def _calling_module(self) -> str | None:
        """The innermost watched module whose code is running (called only at guarded ops, a few per step).

        Walking the Python frames here replaces a pre-hook on every module's forward.
        """
        frame = sys._getframe(2)
        names = self._module_names
        while frame is not None:
            owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
            if owner is not None and id(owner) in names:
                return names[id(owner)] or None  # the LightningModule itself: "" -> None
            frame = frame.f_back  # type: ignore[assignment]
        return None

    def _state_tensors(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, with_optimizer: bool
    ) -> tuple[list[torch.Tensor], list[str]]:
        """Parameters and buffers (and optimizer state), with names, for the state check."""
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        for n, p in self._named_params:
            tensors.append(p)
            names.append(n)
        for n, b in self._named_buffers:
            if n not in self._unchecked_buffers:
                tensors.append(b)
                names.append(n)
        if with_optimizer:
            t, n_ = self._optimizer_state_tensors(trainer)
            tensors.extend(t)
            names.extend(n_)
        return tensors, names

    def _optimizer_state_tensors(self, trainer: pl.Trainer) -> tuple[list[torch.Tensor], list[str]]:
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        for i, opt in enumerate(trainer.optimizers):
            for param, state in opt.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and checks.is_checkable(value):
                        tensors.append(value)
                        names.append(f"optimizer[{i}].state[{self._param_names.get(id(param), '?')}].{key}")
        return tensors, names

    def _coverage(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = check_coverage(pl_module, trainer.optimizers)
        events = [
            self._event(
                trainer,
                "optimizer_coverage",
                names,
                {"problem": problem, "hint": hint},
                trainer.global_step,
                "none",
            )
            for problem, names, hint in report.problems()
        ]
        self._coverage_report(trainer, events)

    def _coverage_report(self, trainer: pl.Trainer, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        self._record(trainer, events)
        if self.check_optimizer_coverage == "error":
            raise NumGuardError("NumGuard: " + " | ".join(e["message"] for e in events))

    def _quarantine_flag(self, batch: Any, batch_idx: int, step: int) -> torch.Tensor | None:
        """A device flag: does this batch hold quarantined samples? (read with the step's flags).

        Matches the sample indices a batch carries (``batch["index"]`` and the like), which stay
        right after a mid-epoch resume; without them, the batch position in the epoch.
        """
        known = [i for q in self.quarantined for i in (q.get("sample_indices") or [])]
        indices = _index_tensor(batch)
        if known and indices is not None:
            cached = self._quarantine_known
            if cached is None or cached[0] != len(known) or cached[1].device != indices.device:
                # copied to the device once per quarantine change, not every step
                cached = self._quarantine_known = (len(known), torch.tensor(known, device=indices.device))
            return torch.isin(indices, cached[1]).any().float()
        if any(
            q["batch_idx"] == batch_idx and q["step"] != step and not q.get("sample_indices") for q in self.quarantined
        ):
            return torch.ones(())
        return None

    # -------------------------------------------------------------- the read

    def _read(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer | None,
        grads_only: bool = False,
    ) -> None:
        """Pack every flag of the step, all-reduce once, read once; on a hit, find the culprits.

        ``grads_only``: a second optimizer stepping in the same batch; inputs, outputs and the loss
        were already read with the first one.
        """
        rec = self._step_rec
        assert rec is not None
        if grads_only:
            rec.inputs, rec.losses = [], []
            if self._watch is not None:
                self._watch.reset()
            if self._opguard is not None:
                self._opguard.reset()
        rec.read_done = True
        rec.step = trainer.global_step
        device = pl_module.device
        world, rank = trainer.world_size, trainer.global_rank

        if (
            not self._coverage_grad_checked
            and optimizer is not None
            and self.check_optimizer_coverage != "off"
            and rec.forced_skip is None
        ):
            self._coverage_grad_checked = True
            params = [p for g in optimizer.param_groups for p in g["params"]]
            missing = never_got_grad(pl_module, params)
            if missing:
                self._coverage_report(
                    trainer,
                    [
                        self._event(
                            trainer,
                            "optimizer_coverage",
                            missing,
                            {
                                "problem": "trainable parameters that received no gradient in the first step",
                                "hint": "they are unused in the forward pass (or detached): freeze them or remove them "
                                "from the optimizer; under DDP also set find_unused_parameters",
                            },
                            rec.step,
                            "none",
                        )
                    ],
                )

        # Everything norm-checked goes into one flag: one _foreach_norm per (device, dtype) group.
        # Which segment holds the candidate is found only after a hit.
        segments: dict[str, list[tuple[str, torch.Tensor]]] = {}
        snapshot_due = self.action != "warn" and (
            trainer.global_step - self._last_snapshot_step >= self.snapshot_every_n_steps
        )
        every_buffer = "buffers" in self.check or "params" in self.check
        wanted = {
            "params": "params" in self.check or snapshot_due,
            "start_buffers": every_buffer or snapshot_due,  # buffers as they were before the forward pass
            "opt_state": "optimizer_state" in self.check or snapshot_due,
        }
        for name, on in wanted.items():
            if on and (named := self._state_segment(name, trainer, rec)):
                segments[name] = named
        if "grads" in self.check and optimizer is not None:
            names = self._param_names
            segments["grads"] = [
                (names.get(id(p), "?"), p.grad)
                for g in optimizer.param_groups
                for p in g["params"]
                if p.grad is not None and checks.is_checkable(p.grad)
            ]
        if every_buffer:  # buffers after the forward pass (BatchNorm running stats)
            segments["live_buffers"] = self._checked_buffers
        norm_total = checks.norm_total([t for seg in segments.values() for _, t in seg], device)

        # A NaN or Inf anywhere propagates into these maxima and sums: one isfinite() flags them all.
        zero = torch.zeros((), dtype=torch.float32, device=device)
        input_max = (
            (rec.inputs[0][1] if len(rec.inputs) == 1 else torch.stack([v for _, v in rec.inputs]).amax())
            if rec.inputs
            else zero
        )
        watch = self._watch if self._watch is not None and self._watch.enabled else None
        loss_total = (
            torch.stack([x.detach().to(device, torch.float32) for x in rec.losses]).sum() if rec.losses else zero
        )
        raw = torch.stack([input_max, norm_total, watch.total(device) if watch is not None else zero, loss_total])
        flags = [
            (~torch.isfinite(raw)).float(),  # _INPUT, _NORMS, _OUTPUT, _LOSS
            torch.stack(
                [
                    (input_max >= self.max_abs_input).float() if self.max_abs_input is not None else zero,
                    self._opguard.flags(device).amax() if self._opguard is not None and self._opguard.records else zero,
                    rec.quarantine_flag.to(device) if rec.quarantine_flag is not None else zero,
                ]
            ),  # _SUSPICIOUS, _OP, _QUARANTINE
        ]
        packed = torch.cat(flags)
        if world > 1:
            packed = packed * float(world - rank)
            packed = trainer.strategy.reduce(packed, reduce_op="max")
        values = packed.tolist()  # the one host read of the step
        seen_rank = [int(world - v) if v > 0 else -1 for v in values]
        if values[_QUARANTINE] > 0 and rec.forced_skip is None:
            rec.forced_skip = "it holds samples quarantined after they failed before"

        if max(values) <= 0 and rec.forced_skip is None:
            if snapshot_due:
                self._take_snapshot(trainer, pl_module, rec)
            return
        self._on_hit(trainer, pl_module, optimizer, rec, seen_rank, segments, snapshot_due)

    def _on_hit(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer | None,
        rec: _Step,
        seen_rank: list[int],
        segments: dict[str, list[tuple[str, torch.Tensor]]],
        snapshot_due: bool,
    ) -> None:
        rank = trainer.global_rank

        def confirmed(segment: str) -> list[str]:
            if segment in segments:
                named = segments[segment]
                if seen_rank[_NORMS] < 0:  # part of the step's flag, which proved it finite
                    return []
            else:  # not checked every step: after a hit, look at it exactly (the root cause may be there)
                named = self._state_segment(segment, trainer, rec)
            if not named:
                return []
            return [n for (n, _), b in zip(named, checks.confirm_nonfinite([t for _, t in named])) if b]

        if rec.forced_skip is not None:
            # A batch known to be bad (quarantined) or in the window after a rollback: skip it quietly.
            rec.bad, rec.action = True, self._decide(False, False)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            self.counters["skipped_steps"] += 1
            if not _any_rank(trainer, confirmed("params") + confirmed("start_buffers") + confirmed("opt_state")):
                self._take_snapshot(trainer, pl_module, rec)  # the state before this batch is verified finite
            log.info("numguard skipped batch %s at step %s: %s", rec.batch_idx, rec.step, rec.forced_skip)
            return

        # Norm candidates are exact only after confirmation (a huge finite value can overflow a norm).
        # Collective: every rank holds the same flag vector, so every rank takes these calls.
        state_bad = _any_rank(trainer, confirmed("params") + confirmed("start_buffers") + confirmed("opt_state"))
        grad_bad = _any_rank(trainer, confirmed("grads"))
        buffer_bad = _any_rank(trainer, confirmed("live_buffers"))

        scaler = getattr(trainer.precision_plugin, "scaler", None)
        local_only = [seen_rank[i] >= 0 for i in (_INPUT, _SUSPICIOUS, _OUTPUT, _OP, _LOSS)]
        if grad_bad and scaler is not None and not any(local_only) and not state_bad:
            # fp16 AMP: non-finite gradients are the GradScaler's business (it skips and backs off).
            self.counters["amp_overflow_steps"] += 1
            grad_bad = []

        # (kind, where, details, rank), appended in causal order: inputs, state before the step,
        # module outputs in execution order, op domains, loss, gradients, buffers after the forward.
        found: list[tuple[str, list[str], dict[str, Any], int]] = []
        if (
            seen_rank[_INPUT] == rank
            or seen_rank[_SUSPICIOUS] == rank
            or (trainer.world_size > 1 and (seen_rank[_INPUT] >= 0 or seen_rank[_SUSPICIOUS] >= 0))
        ):
            found.extend(self._input_findings(rec, rank))
        if state_bad:
            found.append(("nonfinite_param", state_bad, {"when": "before the optimizer step"}, seen_rank[_NORMS]))
        first_module: str | None = None
        if self._watch is not None and seen_rank[_OUTPUT] >= 0:
            bad_modules = self._watch.first_bad()
            if bad_modules:
                first_module, lo, hi = bad_modules[0]
                also = [m for m, _, _ in bad_modules[1:6]]
                found.append(("nonfinite_output", [first_module], {"min": lo, "max": hi, "also": also}, rank))

        # Replay the batch with full instrumentation where something went bad in the forward or backward
        # pass: it names the first module (when outputs are not watched every step) and the first op.
        replay: dict[str, Any] = {}
        if (
            self.replay
            and self.action != "warn"
            and rec.batch is not None
            and (seen_rank[_OUTPUT] >= 0 or seen_rank[_OP] >= 0 or seen_rank[_LOSS] >= 0 or grad_bad)
        ):
            replay = self._replay(trainer, pl_module, rec)
            if first_module is None and replay.get("forward_module"):
                first_module = replay["forward_module"]
                op = replay.get("forward_op")
                where = [first_module] + ([op] if op else [])
                found.append(("nonfinite_output", where, {"replay": replay}, rank))
            for kind, where, details, _ in found:
                if kind == "nonfinite_output" and "replay" not in details:
                    details["replay"] = replay
                    op = replay.get("forward_op") or replay.get("op")
                    if op and op not in where:
                        where.append(op)

        if self._opguard is not None and seen_rank[_OP] >= 0:
            found.extend(self._op_findings(first_module, rank))
        if seen_rank[_LOSS] == rank or (trainer.world_size > 1 and seen_rank[_LOSS] >= 0 and rec.losses):
            loss_vals = [float(x.float().mean()) for x in rec.losses]
            if any(not math.isfinite(v) for v in loss_vals):
                found.append(("nonfinite_loss", ["loss"], {"values": loss_vals}, rank))
        if grad_bad:
            grad_details: dict[str, Any] = {}
            if replay:
                grad_details["replay"] = replay
                grad_bad = grad_bad + [n for n in (replay.get("op"), replay.get("module")) if n and n not in grad_bad]
            found.append(("nonfinite_grad", grad_bad, grad_details, seen_rank[_NORMS]))
        if buffer_bad:
            found.append(("nonfinite_param", buffer_bad, {"when": "after the forward pass"}, seen_rank[_NORMS]))

        # Gather local findings from every rank so that rank 0 can write them.
        found = _gather_findings(trainer, found)
        _mark_consequences(found)
        if not found:
            if snapshot_due:
                self._take_snapshot(trainer, pl_module, rec)
            return

        action = self._decide(bool(state_bad), bool(found))
        rec.bad = action != "warn"
        rec.action = action
        if rec.bad and optimizer is not None:
            # the step becomes a no-op: no momentum, weight decay or step count moves
            optimizer.zero_grad(set_to_none=True)
        if rec.bad:
            self.counters["skipped_steps"] += 1
        if rec.bad and not state_bad:
            # The state before this step is verified finite: keep it, so a rollback undoes exactly this step.
            self._take_snapshot(trainer, pl_module, rec)

        rec.events = [
            self._event(trainer, kind, where, details, rec.step, action, seen_rank=r, rec=rec)
            for kind, where, details, r in found
        ]
        if found:
            key = _position_key(rec)
            self.position_incidents[key] = self.position_incidents.get(key, 0) + 1

    def _state_segment(self, segment: str, trainer: pl.Trainer, rec: _Step) -> list[tuple[str, torch.Tensor]]:
        """The named tensors of one state segment, for the step's flag or for an exact look after a hit."""
        if segment == "params":
            return self._named_params
        if segment == "opt_state":
            t, n = self._optimizer_state_tensors(trainer)
            return list(zip(n, t))
        if segment == "start_buffers" and rec.start_buffers is not None:
            return [(n, rec.start_buffers[n]) for n, _ in self._checked_buffers]
        if segment == "live_buffers":
            return self._checked_buffers
        return []

    def _replay(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: _Step) -> dict[str, Any]:
        from lightning_numguard.callbacks._replay import replay_batch

        watching = self._watch.enabled if self._watch is not None else False
        if self._watch is not None:
            self._watch.enabled = False
        try:
            return replay_batch(trainer, pl_module, rec.batch, rec.batch_idx, rec.start_rng)
        finally:
            if self._watch is not None:
                self._watch.enabled = watching

    def _input_findings(self, rec: _Step, rank: int) -> list[tuple[str, list[str], dict[str, Any], int]]:
        out: list[tuple[str, list[str], dict[str, Any], int]] = []
        for leaves, _ in rec.inputs:
            paths = [p for p, _ in leaves]
            values = checks.max_abs([t for _, t in leaves]).tolist()  # exact, per tensor: after a hit only
            nonfinite = [p for p, v in zip(paths, values) if not math.isfinite(v)]
            if nonfinite:
                stats = checks.tensor_stats(dict(leaves)[nonfinite[0]])
                out.append(("nonfinite_input", nonfinite, {"stats": stats}, rank))
            if self.max_abs_input is not None:
                huge = [(p, v) for p, v in zip(paths, values) if math.isfinite(v) and v >= self.max_abs_input]
                if huge:
                    out.append(
                        (
                            "suspicious_input",
                            [p for p, _ in huge],
                            {"max_abs": huge[0][1], "threshold": self.max_abs_input},
                            rank,
                        )
                    )
        return out

    def _op_findings(self, first_module: str | None, rank: int) -> list[tuple[str, list[str], dict[str, Any], int]]:
        assert self._opguard is not None
        out: list[tuple[str, list[str], dict[str, Any], int]] = []
        flags = self._opguard.flags(self._opguard.records[0].flag.device).tolist() if self._opguard.records else []
        for record, flag in zip(self._opguard.records, flags):
            if flag:
                details = dict(OpGuard.describe(record))
                if first_module:
                    details["upstream"] = first_module
                where = [record.op] + ([record.module] if record.module else [])
                out.append(("op_domain", where, details, rank))
        return out

    def _decide(self, state_bad: bool, has_incident: bool) -> str:
        """The configured action, escalated: skip -> rollback when the state itself went bad,
        rollback -> halt without a finite snapshot or past ``max_rollbacks``."""
        action = self.action
        if action == "skip" and state_bad:
            action = "rollback"
        if action == "rollback" and (
            self._snapshot is None or (has_incident and self._rollbacks_this_fit >= self.max_rollbacks)
        ):
            action = "halt"
        return action

    # -------------------------------------------------------------- acting

    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: _Step) -> None:
        """Keep the state at the start of this step (just verified finite by the step's read)."""
        self._snapshot = capture(
            pl_module,
            trainer.optimizers,
            self._stateful,
            step=rec.step,
            where=self.snapshot_device,
            rng=rec.start_rng,
            model_state=rec.start_buffers,
            stateful_state=rec.start_states,
            reuse=self._snapshot,
        )
        self._last_snapshot_step = rec.step

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: _Step) -> None:
        action = rec.action
        if action == "skip":
            self._restore_step_start(pl_module, rec)
        elif action == "rollback":
            self._rollback(trainer, pl_module, rec)
        elif action == "halt":
            self._halt(trainer, pl_module, rec)
        self._record(trainer, rec.events)
        if action == "halt" and trainer.should_stop and not self._lightning_will_stop(trainer):
            raise NonFiniteError(
                f"NumGuard halted training at step {rec.step}: "
                + (rec.events[0]["message"] if rec.events else "non-finite values")
                + f". The last finite state is in {self._ckpt_path()}."
            )

    def _restore_step_start(self, pl_module: pl.LightningModule, rec: _Step) -> None:
        if rec.start_buffers:
            pl_module.load_state_dict(rec.start_buffers, strict=False)
        if rec.start_states:
            for name, state in rec.start_states.items():
                if name.startswith("metric:"):
                    self._stateful[name].load_state_dict(clone_tree(state))

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: _Step) -> None:
        assert self._snapshot is not None
        restore(self._snapshot, pl_module, trainer.optimizers, self._stateful)
        if not rec.events:  # a forced skip (skip window / quarantine): not a new rollback
            return
        self._rollbacks_this_fit += 1
        self.counters["rollbacks"] += 1
        self._skip_remaining = self.skip_batches_after_rollback
        if self.lr_backoff != 1.0:
            lrs = apply_lr_backoff(trainer, self.lr_backoff)
            for e in rec.events:
                e["details"]["lr_after_backoff"] = lrs
        if self.retry_transient:
            self._retry(trainer, pl_module, rec)
        elif self.quarantine and self.position_incidents.get(_position_key(rec), 0) >= 2:
            self._quarantine(trainer, rec, "failed at the same position more than once")
        self._save_last_finite(trainer)

    def _retry(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: _Step) -> None:
        """Run the batch once more from the restored state: transient incidents pass the second time."""
        from lightning_numguard.callbacks._replay import _loss_of

        if rec.start_rng is not None:
            set_rng_state(rec.start_rng)
        pl_module.zero_grad(set_to_none=True)
        ok = True
        try:
            with torch.enable_grad():
                loss = _loss_of(pl_module.training_step(rec.batch, rec.batch_idx))
                if loss is None or not bool(torch.isfinite(loss.detach()).all()):
                    ok = False
                else:
                    loss.backward()
                    grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
                    ok = not any(checks.confirm_nonfinite(grads))
        except Exception:
            ok = False
        ok = not _any_rank(trainer, [] if ok else ["retry"])
        for e in rec.events:
            e["details"]["retry"] = "transient: finite on retry" if ok else "persistent: non-finite again"
        if ok and len(trainer.optimizers) == 1 and pl_module.automatic_optimization:
            trainer.optimizers[0].step()
            trainer.optimizers[0].zero_grad(set_to_none=True)
            rec.events and rec.events[0]["details"].setdefault("retry_trained", True)
            return
        pl_module.zero_grad(set_to_none=True)
        assert self._snapshot is not None
        restore(self._snapshot, pl_module, trainer.optimizers, self._stateful)
        if not ok and self.quarantine:
            self._quarantine(trainer, rec, "non-finite again when re-run from the last finite state")

    def _quarantine(self, trainer: pl.Trainer, rec: _Step, reason: str) -> None:
        if any(q["batch_idx"] == rec.batch_idx for q in self.quarantined):
            return
        entry: dict[str, Any] = {
            "epoch": rec.epoch,
            "batch_idx": rec.batch_idx,
            "step": rec.step,
            "reason": reason,
            "sample_indices": _sample_indices(rec.batch),
        }
        if trainer.is_global_zero and self._reporter is not None:
            folder = self._reporter.dirpath / "bad_batches"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"epoch{rec.epoch}_batch{rec.batch_idx}_step{rec.step}.pt"
            torch.save({**entry, "batch": _plain(rec.batch)}, path)
            entry["file"] = str(path)
        self.quarantined.append(entry)
        for e in rec.events:
            e["details"]["quarantined"] = True

    def _halt(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rec: _Step) -> None:
        if self._snapshot is not None:
            restore(self._snapshot, pl_module, trainer.optimizers, self._stateful)
            self._save_last_finite(trainer)
        trainer.should_stop = True

    def _lightning_will_stop(self, trainer: pl.Trainer) -> bool:
        return bool(trainer.fit_loop._can_stop_early)  # what Lightning itself consults

    def _ckpt_path(self) -> Path:
        assert self._reporter is not None
        return self._reporter.dirpath / "last_finite.ckpt"

    def _save_last_finite(self, trainer: pl.Trainer) -> None:
        """Write the (restored, finite) live state as a normal Lightning checkpoint, atomically."""
        final = self._ckpt_path()
        tmp = final.with_name(final.name + ".tmp")
        if trainer.is_global_zero:
            final.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(tmp, weights_only=False)  # collective: every rank calls it
        if trainer.is_global_zero:
            os.replace(tmp, final)

    # -------------------------------------------------------------- reporting

    def _event(
        self,
        trainer: pl.Trainer,
        kind: str,
        where: list[str],
        details: dict[str, Any],
        step: int,
        action: str,
        seen_rank: int | None = None,
        rec: _Step | None = None,
    ) -> dict[str, Any]:
        rank = trainer.global_rank if seen_rank is None or seen_rank < 0 else seen_rank
        message = incident_message(kind, where, details, step, rank)
        return Event(
            kind=kind,
            step=step,
            epoch=rec.epoch if rec is not None else trainer.current_epoch,
            batch_idx=rec.batch_idx if rec is not None else -1,
            rank=rank,
            where=list(where),
            action=action,
            message=message,
            details=details,
        ).to_dict()

    def _record(self, trainer: pl.Trainer, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        self.counters["incidents"] += sum(1 for e in events if e["kind"] != "optimizer_coverage")
        for e in events:
            self.incidents_by_kind[e["kind"]] = self.incidents_by_kind.get(e["kind"], 0) + 1
        self.events.extend(events)
        if self._reporter is not None:
            self._reporter.emit(trainer, events, self.counters)


# ---------------------------------------------------------------------- helpers


def _choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise NumGuardConfigError(f"`{name}` must be one of {list(allowed)}, got {value!r}")


def _int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise NumGuardConfigError(f"`{name}` must be an integer >= {minimum}, got {value!r}")


def _accumulating(trainer: pl.Trainer) -> bool:
    """Whether this batch is a gradient-accumulation micro-batch (its optimizer step comes later).

    Lightning has no public accessor; this helper owns the private access.
    """
    try:
        return bool(trainer.fit_loop.epoch_loop._should_accumulate())
    except AttributeError:  # pragma: no cover
        return False


def _any_rank(trainer: pl.Trainer, names: list[str]) -> list[str]:
    """``names`` if any rank found something (collective; only called after a hit on every rank)."""
    if trainer.world_size <= 1:
        return names
    gathered = _all_gather_object(names)
    merged: list[str] = []
    for part in gathered:
        merged.extend(n for n in part if n not in merged)
    return merged


def _all_gather_object(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _causal_position(kind: str, details: dict[str, Any]) -> int:
    """Where in a step a finding happens (``KINDS`` is in causal order); buffers poisoned by the forward come last."""
    if kind == "nonfinite_param" and details.get("when") == "after the forward pass":
        return len(KINDS)
    return KINDS.index(kind) if kind in KINDS else len(KINDS) + 1


def _gather_findings(trainer: pl.Trainer, found: list[Any]) -> list[Any]:
    if trainer.world_size <= 1:
        return found
    merged: list[Any] = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for part in _all_gather_object(found):
        for kind, where, details, rank in part:
            key = (kind, tuple(where))
            if key not in seen:
                seen.add(key)
                merged.append((kind, where, details, rank))
    # each rank appended in causal order (its position in the step); keep that order across ranks
    merged.sort(key=lambda f: (_causal_position(f[0], f[2]), f[3]))
    return merged


def _tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


_INDEX_KEYS = ("index", "indices", "idx", "sample_index", "sample_indices")


def _index_tensor(batch: Any) -> torch.Tensor | None:
    """The integer sample-index tensor a batch carries, if any (``batch["index"]`` and the like)."""
    if isinstance(batch, dict):
        for key in _INDEX_KEYS:
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
                return value.reshape(-1)
    return None


def _mark_consequences(found: list[tuple[str, list[str], dict[str, Any], int]]) -> None:
    """Tell every finding after the step's first one (the root cause) what that cause was.

    Their messages then point at it instead of a hint that assumes clean upstream values.
    """
    if len(found) < 2:
        return
    kind, where, _, _ = found[0]
    cause = f"{kind} in `{where[0]}`" if where else kind
    for _, _, details, _ in found[1:]:
        details.setdefault("after", cause)


def _sample_indices(batch: Any) -> list[int] | None:
    """The batch's sample indices as a list (syncs; after a hit only)."""
    indices = _index_tensor(batch)
    return [int(v) for v in indices.tolist()] if indices is not None else None


def _position_key(rec: _Step) -> str:
    """Where in the data an incident happened: its samples when known, else the batch position."""
    samples = _sample_indices(rec.batch)
    return f"samples:{','.join(map(str, samples))}" if samples else f"batch:{rec.batch_idx}"


def _plain(obj: Any) -> Any:
    """A copy of ``obj`` made of tensors (on the CPU), dicts, lists and primitives: loadable with weights_only."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {f: _plain(getattr(obj, f)) for f in obj._fields}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return repr(obj)
