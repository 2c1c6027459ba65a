"""The user's own frame: the innermost call stack entry outside torch, Lightning, this package and the stdlib.

Messages and warnings point there (``file:line``), never at a frame inside ``lightning_numguard``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType

from lightning_numguard._compat import caller_frame

__all__ = ["is_library_file", "user_frame", "user_site"]

_LIBRARIES = ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics", "lightning_numguard")


_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(dirs)


def _stdlib_dirs() -> tuple[str, ...]:
    """The standard library's folders. In a virtual environment ``platstdlib`` is the environment's ``lib/pythonX.Y``,
    which also holds ``site-packages``: an installed package there (``transformers``, the user's own) is not stdlib."""
    paths = (sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib"))
    return tuple(os.path.abspath(path) + os.sep for path in paths if path)


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to torch, Lightning, torchmetrics, this package or the stdlib (any other installed
    package, model code such as ``transformers`` included, is user code: its line is where an op was called)."""
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_library_dirs()) or f"{os.sep}site-packages{os.sep}typing_extensions" in path:
        return True
    return path.startswith(_stdlib_dirs()) and not any(part in path for part in _INSTALLED)


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The innermost frame, from ``start`` (the caller's caller by default) outwards, that is user code."""
    frame: FrameType | None = start if start is not None else caller_frame(2)
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def user_site(start: FrameType | None = None) -> tuple[str, int] | None:
    """``(file, line)`` of :func:`user_frame`, or ``None`` when every frame is library code."""
    frame = user_frame(start if start is not None else caller_frame(2))
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None
