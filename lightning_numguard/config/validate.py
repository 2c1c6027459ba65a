"""Validation of ``NumGuardCallback``'s arguments: each bad value raises naming the argument."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Literal, get_args

from lightning_numguard.detect import registry
from lightning_numguard.errors import NumGuardConfigError
from lightning_numguard.reporting.events import SPIKE_ACTIONS, Action

__all__ = [
    "ACTIONS",
    "DEFAULT_SITES",
    "DEFAULT_SPIKE_WARMUP",
    "SITES",
    "Action",
    "CheckSite",
    "checks",
    "choice",
    "extra_checks",
    "flag",
    "flag_or_none",
    "fraction",
    "integer",
    "path_or_none",
    "patterns",
    "positive_or_none",
    "spike_action",
    "spike_group",
]

CheckSite = Literal["inputs", "outputs", "ops", "loss", "grads", "buffers", "params", "optimizer_state"]
ACTIONS: tuple[str, ...] = get_args(Action)
#: the sites ``check=[...]`` names (what each checks, its slot in the packed read and its event kinds:
#: :data:`lightning_numguard.detect.registry.SITES`)
SITES: tuple[str, ...] = get_args(CheckSite)
DEFAULT_SITES: tuple[CheckSite, ...] = ("inputs", "outputs", "ops", "loss", "grads", "buffers")
#: ``spike_warmup=None``: the window judges once it holds this many values (or half of a shorter window).
DEFAULT_SPIKE_WARMUP = 16


def choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise NumGuardConfigError(f"`{name}` must be one of {list(allowed)}, got {value!r}")


def integer(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise NumGuardConfigError(f"`{name}` must be an integer >= {minimum}, got {value!r}")


def flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise NumGuardConfigError(f"`{name}` must be True or False, got {value!r}")


def flag_or_none(name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise NumGuardConfigError(f"`{name}` must be True, False or None (automatic), got {value!r}")
    return value


def checks(value: Any) -> list[str]:
    if isinstance(value, str) or not all(isinstance(c, str) for c in value):
        raise NumGuardConfigError(f"`check` must be a list of strings from {list(SITES)}, got {value!r}")
    for c in value:
        choice("check", c, SITES)
    return list(dict.fromkeys(value))


def extra_checks(value: Any) -> tuple[registry.Check, ...]:
    """``extra_checks``: ``None`` or a list of :class:`~lightning_numguard.detect.registry.Check` instances, each
    registered: its kind known to the events, hints and sentences
    (:func:`~lightning_numguard.detect.registry.register`).
    """
    if value is None:
        return ()
    if isinstance(value, (str, registry.Check)) or not isinstance(value, (list, tuple)):
        raise NumGuardConfigError(
            f"`extra_checks` must be a list of lightning_numguard.Check instances (e.g. [MyCheck(threshold=3.0)]), "
            f"got {value!r}"
        )
    kinds = [getattr(c, "kind", None) for c in value]
    if len(set(kinds)) != len(kinds):
        raise NumGuardConfigError(f"`extra_checks` holds two checks of one kind ({kinds}): give each its own kind")
    # the checks that act first: a deferred read skips the step on the device on the values before the advisory ones
    return tuple(registry.register(c) for c in sorted(value, key=lambda c: bool(getattr(c, "advisory", False))))


def patterns(name: str, value: Any) -> list[str]:
    if isinstance(value, str) or not all(isinstance(p, str) for p in value):
        raise NumGuardConfigError(f"`{name}` must be a list of glob patterns such as ['encoder.*'], got {value!r}")
    return list(value)


def positive_or_none(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise NumGuardConfigError(f"`{name}` must be a positive number or None, got {value!r}")
    return float(value)


def fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1 or not math.isfinite(value):
        raise NumGuardConfigError(f"`{name}` must be a number in (0, 1], got {value!r}")
    return float(value)


def path_or_none(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise NumGuardConfigError(f"`{name}` must be a path or None, got {value!r}")
    return os.fspath(value)


def spike_group(
    sigma: Any, window: Any, warmup: Any, rollback_after: Any, headroom: Any
) -> tuple[float, int, float | None]:
    """Check the ``spikes`` group; returns ``(sigma, warmup, headroom)`` as plain numbers (``warmup`` resolved)."""
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 < sigma < math.inf:
        raise NumGuardConfigError(f"`spikes.sigma` must be a positive number, got {sigma!r}")
    integer("spikes.window", window, 0)
    if warmup is None:
        warmup = max(min(window // 2, DEFAULT_SPIKE_WARMUP), 1)
    elif isinstance(warmup, bool) or not isinstance(warmup, int) or not 1 <= warmup <= max(window, 1):
        raise NumGuardConfigError(
            f"`spikes.warmup` must be None or an integer in [1, spikes.window={window}], got {warmup!r} (the window "
            "judges once it holds spikes.warmup values: lower spikes.warmup or raise spikes.window)"
        )
    integer("spikes.rollback_after", rollback_after, 0)
    if headroom is not None and (
        isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 1 <= headroom < math.inf
    ):
        raise NumGuardConfigError(f"`spikes.overflow_headroom` must be a number >= 1 or None (off), got {headroom!r}")
    return float(sigma), int(warmup), None if headroom is None else float(headroom)


def spike_action(action: str, spike_action: Any, window: int) -> None:
    """Check ``spike_action`` against ``action`` and the spike window."""
    if spike_action is None:
        return
    choice("spike_action", spike_action, SPIKE_ACTIONS)
    if window == 0:
        raise NumGuardConfigError(
            f"`spike_action={spike_action!r}` needs spike statistics: `spikes.window` must be an integer >= 1, got 0"
        )
    if action == "warn" and spike_action in ("skip", "rollback"):
        raise NumGuardConfigError(
            f"`spike_action={spike_action!r}` acts on finite spikes while `action='warn'` lets NaN steps through: "
            "use action='skip' or 'rollback' with it, or spike_action='warn'"
        )
