"""``NumGuard``, the Lightning Fabric callback (``Fabric(callbacks=[NumGuard()])``); see
:mod:`lightning_numguard.doors.fabric.callback`."""

from lightning_numguard.doors.fabric.callback import NumGuard

__all__ = ["NumGuard"]
