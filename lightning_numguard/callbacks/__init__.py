"""Lightning callbacks: one public callback per file."""

from lightning_numguard.callbacks.numguard import NumGuardCallback

__all__ = ["NumGuardCallback"]
