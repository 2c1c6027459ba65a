"""Argument types that carry their constraints to jsonargparse, so LightningCLI refuses a bad value while parsing.

With jsonargparse installed (the ``cli`` extra), ``PositiveInt``, ``NonNegativeInt`` and ``PositiveFloat`` are
jsonargparse's restricted number types and ``Backoff`` (``(0, 1]``) and ``Headroom`` (``>= 1``) ones made here:
LightningCLI rejects ``-3`` before anything is built, naming the argument, the restriction and the value,
instead of a traceback from ``__init__``. Without jsonargparse they are ``int`` and ``float``. Type checkers
see ``int``/``float`` always. ``NumGuardCallback.__init__`` checks every value either way (Python callers),
and stores plain numbers; it also refuses what one argument's type cannot say (``spike_warmup <=
spike_window``) with ``NumGuardConfigError``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

__all__ = ["Backoff", "Headroom", "NonNegativeInt", "PositiveFloat", "PositiveInt", "plain_args"]


def _restricted() -> tuple[Any, Any, Any, Any, Any]:
    try:
        from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt, restricted_number_type
    except ImportError:  # the cli extra is not installed: nothing parses these hints but Python itself
        return int, int, float, float, float
    made = []
    for name, limits in (("float in (0, 1]", [(">", 0.0), ("<=", 1.0)]), ("float >= 1", [(">=", 1.0)])):
        try:
            made.append(restricted_number_type(name, float, limits))
        except ValueError:  # the same restriction registered under another name (by another library): unchecked
            made.append(float)
    return PositiveInt, NonNegativeInt, PositiveFloat, made[0], made[1]


if TYPE_CHECKING:
    PositiveInt = int
    NonNegativeInt = int
    PositiveFloat = float
    Backoff = float
    Headroom = float
else:
    PositiveInt, NonNegativeInt, PositiveFloat, Backoff, Headroom = _restricted()


def plain_args(doc: str | None) -> str | None:
    """``doc`` with the reStructuredText literals of its ``Args:`` section (````x````) written as ```x```.

    jsonargparse prints each argument's ``Args:`` entry as LightningCLI's ``--help`` text, where doubled
    backticks are noise; the source keeps RST, so entries added later need no care.
    """
    if doc is None:
        return None
    match = re.search(r"^(\s*)Args:\n.*?(?=^\1\S|\Z)", doc, flags=re.MULTILINE | re.DOTALL)
    if match is None:
        return doc
    return doc[: match.start()] + match.group(0).replace("``", "`") + doc[match.end() :]
