"""``lightning_numguard.callbacks.NumGuardCallback``: the same class as :class:`lightning_numguard.NumGuardCallback`."""

from lightning_numguard.doors.trainer.callback import NumGuardCallback

__all__ = ["NumGuardCallback"]
