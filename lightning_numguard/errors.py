"""The errors and warnings of ``lightning_numguard``.

The exception tree::

    NumGuardError                       base of everything raised by this package
    ├── NonFiniteError (RuntimeError)   training stopped on a non-finite value
    └── NumGuardConfigError (ValueError) a bad argument, named with allowed and received values

    NumGuardWarning (UserWarning)       every warning the guard emits
"""

from __future__ import annotations

__all__ = ["NonFiniteError", "NumGuardConfigError", "NumGuardError", "NumGuardWarning"]


class NumGuardError(Exception):
    """Base class of every error raised by ``lightning_numguard``."""


class NonFiniteError(NumGuardError, RuntimeError):
    """Training was stopped because a value went non-finite and could not be recovered."""


class NumGuardConfigError(NumGuardError, ValueError):
    """A configuration value is invalid; the message names the argument, the allowed and the received value."""


class NumGuardWarning(UserWarning):
    """A warning emitted by ``lightning_numguard`` (incidents under ``action="warn"``, coverage problems)."""
