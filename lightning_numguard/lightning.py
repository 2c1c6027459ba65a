"""``NumGuardCallback`` for users of the ``lightning`` package (``import lightning.pytorch as L``); see
:mod:`lightning_numguard.doors.trainer.lightning_pkg`."""

from lightning_numguard.doors.trainer.lightning_pkg import NumGuardCallback

__all__ = ["NumGuardCallback"]
