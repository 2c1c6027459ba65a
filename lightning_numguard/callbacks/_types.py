"""Argument types that carry their constraints to jsonargparse, so LightningCLI refuses a bad value while parsing.

With jsonargparse installed (the ``cli`` extra), ``PositiveInt``, ``NonNegativeInt`` and ``PositiveFloat`` are
jsonargparse's restricted number types and ``Backoff`` one made here: LightningCLI rejects ``-3`` before
anything is built, naming the argument, the restriction and the value, instead of a traceback from
``__init__``. Without jsonargparse they are ``int`` and ``float``. Type checkers see ``int``/``float`` always.
``NumGuardCallback.__init__`` checks every value either way (Python callers), and stores plain numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Backoff", "NonNegativeInt", "PositiveFloat", "PositiveInt"]


def _restricted() -> tuple[Any, Any, Any, Any]:
    try:
        from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt, restricted_number_type
    except ImportError:  # the cli extra is not installed: nothing parses these hints but Python itself
        return int, int, float, float
    try:
        backoff = restricted_number_type("float in (0, 1]", float, [(">", 0.0), ("<=", 1.0)])
    except ValueError:  # the same restriction registered under another name (by another library): unchecked here
        backoff = float
    return PositiveInt, NonNegativeInt, PositiveFloat, backoff


if TYPE_CHECKING:
    PositiveInt = int
    NonNegativeInt = int
    PositiveFloat = float
    Backoff = float
else:
    PositiveInt, NonNegativeInt, PositiveFloat, Backoff = _restricted()
