"""Every argument of the guard, declared once: :class:`GuardConfig`.

The front doors take exactly these arguments (``NumGuardCallback``, the Fabric ``NumGuard``, ``attach``): each door's
class derives from :class:`GuardConfig`, so its signature, the check of each value, the ``Args:`` of its docstring
and the reference table (``docs/reference.md``) all come from the declarations below. The engine receives a
:class:`GuardConfig` (``config``), read-only once built.

The everyday arguments are top-level; the rest live in four groups (:mod:`~lightning_numguard.config.groups`):
``watch``, ``snapshots``, ``spikes`` and ``recovery``. Their old flat names (``spike_sigma``, ``watch_depth``, ...)
are still accepted, with a ``DeprecationWarning`` saying where each moved.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning_numguard.config import validate
from lightning_numguard.config.argtypes import Backoff, NonNegativeInt, PositiveFloat, PositiveInt
from lightning_numguard.config.declare import Declared, argument, moved
from lightning_numguard.config.groups import RecoveryConfig, SnapshotConfig, SpikeConfig, WatchConfig
from lightning_numguard.config.validate import DEFAULT_SITES, Action, CheckSite
from lightning_numguard.detect.registry import Check
from lightning_numguard.errors import NumGuardConfigError
from lightning_numguard.reporting.events import acting

__all__ = ["SYNC_MODES", "GuardConfig"]

SYNC_MODES = ("every_step", "deferred")


def _choice(*allowed: str) -> Any:
    def check(name: str, value: Any) -> Any:
        validate.choice(name, value, allowed)
        return value

    return check


def _integer(minimum: int) -> Any:
    def check(name: str, value: Any) -> int:
        validate.integer(name, value, minimum)
        return int(value)  # plain, from a CLI's restricted int

    return check


def _flag(name: str, value: Any) -> bool:
    validate.flag(name, value)
    return bool(value)


def _group(group: type) -> Any:
    """A group's check: the group itself, or a mapping of its fields (a Python caller's ``spikes={"sigma": 8}``)."""

    def check(name: str, value: Any) -> Any:
        if isinstance(value, group):
            return value
        if isinstance(value, dict):
            try:
                return group(**value)
            except TypeError as err:
                raise NumGuardConfigError(f"`{name}` got {value!r}: {err}") from None
        raise NumGuardConfigError(f"`{name}` must be a {group.__name__} or a mapping of its fields, got {value!r}")

    return check


def _checks(name: str, value: Any) -> list[str]:
    return validate.checks(value)


def _positive_or_none(name: str, value: Any) -> float | None:
    return validate.positive_or_none(name, value)


def _path_or_none(name: str, value: Any) -> str | None:
    return validate.path_or_none(name, value)


def _fraction(name: str, value: Any) -> float:
    return validate.fraction(name, value)


def _spike_action(name: str, value: Any) -> Any:
    if value is not None:
        validate.choice(name, value, ("warn", "skip", "rollback"))
    return value


def _extra_checks(name: str, value: Any) -> tuple[Check, ...]:
    return validate.extra_checks(value)


class GuardConfig(Declared):
    """The guard's configuration: every argument a front door takes, checked where it is built, read-only after."""

    action: Action = argument(
        default="rollback",
        doc='what to do on an incident. ``"warn"``: record and report only. ``"skip"``: the optimizer step becomes a '
        "no-op (gradients set to ``None``) and buffers changed by the bad forward pass are restored; escalates to "
        '``"rollback"`` when the weights or optimizer state are no longer finite. ``"rollback"``: restore the last '
        'verified-finite state in place and carry on; after ``max_rollbacks`` escalate to ``"halt"``. ``"halt"``: '
        "restore the last finite state, write ``<dirpath>/last_finite.ckpt``, and raise ``NonFiniteError`` on every "
        "rank (see ``recovery.halt_raises``)",
        check=_choice("warn", "skip", "rollback", "halt"),
    )
    dirpath: str | None = argument(
        default=None,
        doc="folder for ``events.jsonl``, ``last_finite.ckpt`` and ``bad_batches/``. Defaults to the loop's log folder "
        "with ``numguard`` appended (a Trainer's ``<log_dir>/numguard``, ``<default_root_dir>/numguard`` without a "
        "logger). Checked when the fit starts (a file in its place, or a folder that cannot be written, raises "
        "``NumGuardConfigError`` before the first step); a halt in a run that writes no file otherwise "
        "(``fast_dev_run``, nowhere chosen) writes its ``last_finite.ckpt`` and ``events.jsonl`` into "
        "``<default_root_dir>/numguard`` and says so",
        check=_path_or_none,
    )
    check: list[CheckSite] = argument(
        doc="which sites to check every step, any of ``inputs``, ``outputs``, ``ops``, ``loss``, ``grads``, "
        "``buffers``, ``params``, ``optimizer_state``. ``outputs`` watches blocks (see ``watch.depth``): one fused "
        "min/max per block into a preallocated device buffer; after a hit the replay names the exact module and op "
        "inside the block. The default leaves out two whose work is repeated elsewhere: ``params`` (a NaN weight "
        "makes the outputs, loss and gradients non-finite, and after any hit the parameters are checked exactly and "
        "named first; they are also verified before every snapshot and checkpoint) and ``optimizer_state`` "
        "(verified before every snapshot; add it to catch a poisoned Adam moment before the step it would ruin)",
        check=_checks,
        factory=lambda: list(DEFAULT_SITES),
    )
    max_abs_input: PositiveFloat | None = argument(
        default=1e18,
        doc="finite batch values with ``|x|`` at or above this are ``suspicious_input`` (numpy's masked-array fill "
        "value 1e20 and netCDF's 9.96921e36 are caught by the default; a value equal to its dtype's own finite "
        "extreme, ``torch.finfo(dtype).min`` in an additive attention mask, is a mask and does not count); "
        "``None`` turns this off. A batch field flagged on 3 consecutive steps with infinities (a mask) is taken "
        "for a convention of the data: said once, then no longer checked in the fit; flagged on 3 consecutive "
        "steps with anything else (a fill value, a huge value, NaN), it is a broken data pipeline and the third "
        "step halts with the fix",
        check=_positive_or_none,
    )
    check_optimizer_coverage: Literal["off", "warn", "error"] = argument(
        default="warn",
        doc='``"warn"`` or ``"error"`` on trainable parameters in no optimizer, frozen parameters in one, parameters '
        'in two groups, trainable parameters that get no gradient; ``"off"`` to skip',
        check=_choice("off", "warn", "error"),
    )
    snapshot_every_n_steps: PositiveInt = argument(
        default=50, doc="take a verified-finite snapshot every this many clean steps", check=_integer(1)
    )
    max_rollbacks: NonNegativeInt = argument(
        default=10, doc='rollbacks allowed in one fit before escalating to ``"halt"``', check=_integer(0)
    )
    skip_batches_after_rollback: NonNegativeInt = argument(
        default=0, doc="batches to skip after each rollback (0 = only the bad one)", check=_integer(0)
    )
    lr_backoff: Backoff = argument(
        default=1.0, doc="factor applied to every learning rate after each rollback (1.0 = unchanged)", check=_fraction
    )
    sync_mode: Literal["every_step", "deferred"] = argument(
        default="every_step",
        doc='``"every_step"`` reads the step\'s flags on the host before the optimizer step (one host read per step). '
        '``"deferred"`` reads nothing on the step: a bad step is skipped on the device through the optimizer\'s '
        "``found_inf`` (needs one fused optimizer, e.g. ``AdamW(..., fused=True)``, automatic optimization and no "
        "fp16 GradScaler; anything else raises ``NumGuardConfigError`` at fit start), its flags are copied to the "
        "host without blocking and read one step later, and a rollback or halt is decided then, from a snapshot "
        "verified before it is needed. Events keep the step of the fault and name the watched block and op call, "
        "not the leaf module inside the block; ``recovery.retry_transient`` is refused and ``recovery.replay`` does "
        "not run (see ``docs/performance.md``)",
        check=_choice(*SYNC_MODES),
    )
    spike_action: Literal["warn", "skip", "rollback"] | None = argument(
        default=None,
        doc="what to do when the loss or the global gradient norm is finite but far above its recent range (see "
        '``docs/reference.md``, "Spikes"; scored as ``spikes`` says). ``None`` (default): the statistics are kept '
        'and logged, no event is recorded. ``"warn"``: record ``loss_spike`` / ``grad_norm_spike`` events. '
        '``"skip"``: the step is skipped atomically like a non-finite one (in ``sync_mode="deferred"``: on the '
        "device, through ``found_inf``); the ``spikes.rollback_after``-th spike within ``spikes.window`` steps rolls "
        'back instead. ``"rollback"``: every spike rolls back to the last snapshot (with '
        "``skip_batches_after_rollback`` and ``lr_backoff``; a rollback landing again on a snapshot already restored "
        'for the same trouble is a repeat: the LR schedule keeps its place). Needs ``action`` other than ``"warn"`` '
        "to act",
        check=_spike_action,
    )
    emit_warnings: bool = argument(
        default=True,
        doc="emit one ``NumGuardWarning`` per root cause's kind and place (its consequences in the same step are "
        "recorded, not warned; events, log lines and loggers are written either way)",
        check=_flag,
    )
    extra_checks: list[Check] | None = argument(
        default=None,
        doc="checks of your own, each a subclass of ``lightning_numguard.Check`` in one file (its kind, hint, where it "
        "records, its 0-d device value and its findings): each is folded into the step's one read, judged like a "
        "built-in check (acted on, or only reported when ``advisory``) and written to the events. In a LightningCLI "
        "YAML file: ``class_path`` and ``init_args``. See ``ARCHITECTURE.md``",
        check=_extra_checks,
    )
    watch: WatchConfig = argument(
        doc="which modules' outputs the ``outputs`` check watches (``modules``, ``ignore``, ``depth``)",
        check=_group(WatchConfig),
        factory=WatchConfig,
    )
    snapshot: SnapshotConfig = argument(
        doc="where snapshots live and how they are copied (``device``, ``sharding``, ``asynchronous``)",
        check=_group(SnapshotConfig),
        factory=SnapshotConfig,
    )
    spikes: SpikeConfig = argument(
        doc="how loss and gradient-norm spikes are scored (``sigma``, ``window``, ``warmup``, ``rollback_after``, "
        "``overflow_headroom``)",
        check=_group(SpikeConfig),
        factory=SpikeConfig,
    )
    recovery: RecoveryConfig = argument(
        doc="how a bad step is recovered beyond ``action`` (``halt_raises``, ``retry_transient``, ``quarantine``, "
        "``replay``, ``max_bad_steps``, ``max_device_faults``, ``restore_callbacks``)",
        check=_group(RecoveryConfig),
        factory=RecoveryConfig,
    )
    # the flat names of the arguments that moved into a group (accepted with a DeprecationWarning, mapped there)
    watch_modules: list[str] | None = moved("watch.modules", default=None)
    ignore_modules: list[str] | None = moved("watch.ignore", default=None)
    watch_depth: int | None = moved("watch.depth", default=None)
    snapshot_device: Literal["host", "device"] | None = moved("snapshot.device", default=None)
    snapshot_sharding: Literal["auto", "off"] | None = moved("snapshot.sharding", default=None)
    snapshot_async: bool | None = moved("snapshot.asynchronous", default=None)
    spike_sigma: float | None = moved("spikes.sigma", default=None)
    spike_window: int | None = moved("spikes.window", default=None)
    spike_warmup: int | None = moved("spikes.warmup", default=None)
    spike_rollback_after: int | None = moved("spikes.rollback_after", default=None)
    overflow_headroom: float | None = moved("spikes.overflow_headroom", default=None)
    halt_raises: bool | None = moved("recovery.halt_raises", default=None)
    retry_transient: bool | None = moved("recovery.retry_transient", default=None)
    quarantine: bool | None = moved("recovery.quarantine", default=None)
    replay: bool | None = moved("recovery.replay", default=None)

    def __post_init__(self) -> None:
        """What one argument's check cannot see: arguments that do not go together."""
        validate.spike_action(self.action, self.spike_action, self.spikes.window)
        if self.sync_mode == "deferred" and self.recovery.retry_transient:
            raise NumGuardConfigError(
                "`recovery.retry_transient=True` re-runs a batch on the host's decision, which `sync_mode='deferred'` "
                "makes one step late: use one or the other"
            )

    @property
    def acting(self) -> bool:
        """Whether the guard acts on a bad step (skip, rollback, halt), not only reports it (``action="warn"``)."""
        return acting(self.action)

    @property
    def config(self) -> GuardConfig:
        """The configuration alone (for a door: a :class:`GuardConfig` of its arguments, not the door itself)."""
        return GuardConfig(**self.arguments())
