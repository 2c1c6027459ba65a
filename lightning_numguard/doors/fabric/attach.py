"""Zero-code attach for Lightning Fabric: its callback-factory entry points add the guard when the environment asks.

Fabric calls every function registered under ``lightning.fabric.callbacks_factory`` (the ``lightning`` package) or
``lightning_fabric.callbacks_factory`` (the standalone ``lightning_fabric`` package) while a ``Fabric`` is built,
and adds the callbacks it returns; this package registers one factory per group. The opt-in is the Trainer's
(:mod:`~lightning_numguard.doors.optin`): ``NUMGUARD=1`` or ``NUMGUARD_CONFIG=numguard.yaml`` in the environment of
the process that builds the ``Fabric`` (every rank, under a launcher). So ``NUMGUARD=1 litgpt pretrain ...`` guards
LitGPT's pretraining loop with no change to it. A ``Fabric`` that already holds a ``NumGuard`` gets no second one.
"""

from __future__ import annotations

from typing import Any

from lightning_numguard import _compat
from lightning_numguard.doors.optin import build_requested

__all__ = ["fabric_callbacks"]


def fabric_callbacks() -> list[Any]:
    """Entry point of both Fabric groups: ``[NumGuard(...)]`` if opted in, else ``[]``."""
    from lightning_numguard.doors.fabric.callback import NumGuard

    return build_requested(NumGuard, _compat.callbacks_of_fabric_being_built, NumGuard, "Fabric")
