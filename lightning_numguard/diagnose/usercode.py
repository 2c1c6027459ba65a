"""The user's own frame: the innermost call stack entry outside torch, Lightning, this package and the stdlib.

Messages and warnings point there (``file:line``), never at a frame inside ``lightning_numguard``.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from types import FrameType

from lightning_numguard._compat import caller_frame, first_frame

__all__ = ["is_library_file", "user_frame", "user_site"]

_LIBRARIES = (
    "torch",
    "pytorch_lightning",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "torchmetrics",
    "lightning_numguard",
    "jsonargparse",
    "tqdm",
    "rich",
)


def _library_dirs() -> tuple[str, ...]:
    """The libraries' own directories (asked again each time: a library imported later joins them)."""
    dirs = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(dirs)


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    """The standard library's directories (fixed for the process; the replay asks once per frame of every call)."""
    paths = (sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib"))
    return tuple(os.path.abspath(path) + os.sep for path in paths if path)


_INSTALLED = ("site-packages", "dist-packages")


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to torch, Lightning, torchmetrics, this package or the stdlib."""
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if f"{os.sep}site-packages{os.sep}typing_extensions" in path:
        return True
    if path.startswith(_library_dirs()):
        return True
    # a virtual environment's stdlib directory holds its site-packages: an installed model library
    # (transformers, timm) is the model's code, not the standard library
    return path.startswith(_stdlib_dirs()) and not any(f"{os.sep}{d}{os.sep}" in path for d in _INSTALLED)


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The innermost frame, from ``start`` (the caller's caller by default) outwards, that is user code."""
    frame = start if start is not None else caller_frame(2)
    return first_frame(frame, lambda f: not is_library_file(f.f_code.co_filename))


def user_site(start: FrameType | None = None) -> tuple[str, int] | None:
    """``(file, line)`` of :func:`user_frame`, or ``None`` when every frame is library code."""
    frame = user_frame(start if start is not None else caller_frame(2))
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None
