"""The errors and warnings of ``lightning_numguard``.

The exception tree::

    NumGuardError                       base of everything raised by this package
    ├── NonFiniteError (RuntimeError)   training stopped on a non-finite value
    │   └── SuspectedHardwareError      ... made by one rank's device, again and again (exclude the node)
    └── NumGuardConfigError (ValueError) a bad argument, named with allowed and received values

    NumGuardWarning (UserWarning)       every warning the guard emits
"""

from __future__ import annotations

from typing import Any

__all__ = ["NonFiniteError", "NumGuardConfigError", "NumGuardError", "NumGuardWarning", "SuspectedHardwareError"]


class NumGuardError(Exception):
    """Base class of every error raised by ``lightning_numguard``."""


class NonFiniteError(NumGuardError, RuntimeError):
    """Training was stopped because a value went non-finite and could not be recovered."""


class SuspectedHardwareError(NonFiniteError):
    """Training was stopped because one rank's device made non-finite values that the same step, re-run with the same
    weights, inputs and RNG, did not make again (``recovery.max_device_faults`` of them): the message names the rank,
    the host and the device, so that a scheduler can exclude the node.

    Attributes:
        rank: the global rank whose device made them.
        host: its host name (``socket.gethostname()`` on that rank).
        device: its device (``"cuda:1"``, ``"cpu"``).
        faults: the device faults counted on that rank (this fit and the fits it resumed).
    """

    def __init__(self, message: str, rank: int = -1, host: str = "", device: str = "", faults: int = 0) -> None:
        super().__init__(message)
        self.rank, self.host, self.device, self.faults = rank, host, device, faults

    def __reduce__(self) -> tuple[Any, ...]:  # picklable with its fields (a launcher may send it between processes)
        return type(self), (str(self), self.rank, self.host, self.device, self.faults)


class NumGuardConfigError(NumGuardError, ValueError):
    """A configuration value is invalid; the message names the argument, the allowed and the received value."""


class NumGuardWarning(UserWarning):
    """A warning emitted by ``lightning_numguard`` (incidents under ``action="warn"``, coverage problems)."""
