"""Keep PyTorch Lightning training runs alive through NaN and Inf."""

from lightning_numguard.__about__ import __version__
from lightning_numguard.callbacks.numguard import NumGuardCallback
from lightning_numguard.errors import NonFiniteError, NumGuardConfigError, NumGuardError, NumGuardWarning

__all__ = [
    "NonFiniteError",
    "NumGuardCallback",
    "NumGuardConfigError",
    "NumGuardError",
    "NumGuardWarning",
    "__version__",
]
