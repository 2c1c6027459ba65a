"""Keep PyTorch training runs alive through NaN and Inf.

The public surface is ``__all__``. ``NumGuardCallback`` and ``attach`` are imported on first access, so that
the engine (torch and the standard library only) can be used without Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_numguard.__about__ import __version__
from lightning_numguard.config.arguments import GuardConfig
from lightning_numguard.config.groups import RecoveryConfig, SnapshotConfig, SpikeConfig, WatchConfig
from lightning_numguard.detect.registry import Check, CheckStep
from lightning_numguard.diagnose.findings import Finding
from lightning_numguard.errors import (
    NonFiniteError,
    NumGuardConfigError,
    NumGuardError,
    NumGuardWarning,
    SuspectedHardwareError,
)

if TYPE_CHECKING:
    from lightning_numguard.doors.plain.guard import attach
    from lightning_numguard.doors.trainer.callback import NumGuardCallback

__all__ = [
    "Check",
    "CheckStep",
    "Finding",
    "GuardConfig",
    "NonFiniteError",
    "NumGuardCallback",
    "NumGuardConfigError",
    "NumGuardError",
    "NumGuardWarning",
    "RecoveryConfig",
    "SnapshotConfig",
    "SpikeConfig",
    "SuspectedHardwareError",
    "WatchConfig",
    "__version__",
    "attach",
]


def __getattr__(name: str) -> Any:
    if name == "NumGuardCallback":
        from lightning_numguard.doors.trainer.callback import NumGuardCallback

        return NumGuardCallback
    if name == "attach":
        from lightning_numguard.doors.plain.guard import attach

        return attach
    raise AttributeError(f"module 'lightning_numguard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
