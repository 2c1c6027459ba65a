"""Runs in which the guard writes no file: ``fast_dev_run``, and runs with nowhere chosen to write to.

"Nowhere chosen": no logger, no checkpointing, no ``dirpath`` and no ``default_root_dir`` (the
working directory); an explicit ``default_root_dir`` gets ``<default_root_dir>/numguard``.

Lightning promises no logging or checkpointing under ``fast_dev_run``, and writes nothing into the
working directory without a logger and checkpointing; the guard keeps those promises. Its events
stay in memory (``callback.events``) and in the log; a halt restores the last finite state in
memory and says that no ``last_finite.ckpt`` was written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytorch_lightning as pl

__all__ = ["files_folder", "writes_files"]


def files_folder(trainer: pl.Trainer, dirpath: str | None) -> Path | None:
    """Where the guard's files go in this fit: ``dirpath``, else ``<log_dir>/numguard`` (``<default_root_dir>/numguard``
    without a logger); ``None`` when the run writes no file (see :func:`writes_files`)."""
    if not writes_files(trainer, dirpath):
        return None
    return Path(dirpath) if dirpath else Path(trainer.log_dir or trainer.default_root_dir) / "numguard"


def writes_files(trainer: pl.Trainer, dirpath: str | None) -> bool:
    """Whether the guard may write files for ``trainer`` (``dirpath`` is the user's argument)."""
    if getattr(trainer, "fast_dev_run", False):  # set by Trainer.__init__ (public, not in the stubs)
        return False
    if dirpath or trainer.loggers or trainer.checkpoint_callback is not None:
        return True
    # Without a logger and checkpointing Lightning writes nothing into the working directory; a
    # default_root_dir the user chose is a place to write to (events then go to <default_root_dir>/numguard).
    return os.path.abspath(str(trainer.default_root_dir)) != os.path.abspath(os.getcwd())
