"""Runs in which the guard writes no file: ``fast_dev_run``, and runs with nowhere chosen to write to.

"Nowhere chosen": no logger, no checkpointing, no ``dirpath`` and no ``default_root_dir`` (the
working directory); an explicit ``default_root_dir`` gets ``<default_root_dir>/numguard``.

Lightning promises no logging or checkpointing under ``fast_dev_run``, and writes nothing into the
working directory without a logger and checkpointing; the guard keeps those promises. Its events
stay in memory (``callback.events``) and in the log, except at a halt: a halt is a failure, and what it saves
(``last_finite.ckpt``, ``events.jsonl``) must outlive the process, so it writes them into
:func:`halt_folder` (``<default_root_dir>/numguard``) and says where.

The folder a fit writes to is checked when the fit starts (:func:`check_folder`): not a directory, or not writable,
is a ``NumGuardConfigError`` naming ``dirpath`` and the path, before the first step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytorch_lightning as pl

from lightning_numguard.errors import NumGuardConfigError

__all__ = ["check_folder", "files_folder", "halt_folder", "writes_files"]


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


def halt_folder(trainer: pl.Trainer) -> Path:
    """Where a halt writes ``last_finite.ckpt`` and ``events.jsonl`` when the run writes no file otherwise."""
    return Path(trainer.default_root_dir) / "numguard"


def check_folder(folder: Path, given: bool) -> None:
    """Fit start: ``folder`` (the resolved ``dirpath``; ``given``: the user's own) is a directory the guard can write
    into, or can be made one; else :class:`~lightning_numguard.errors.NumGuardConfigError` naming ``dirpath``."""
    origin = "" if given else " (the default, as no dirpath was given)"
    if folder.exists() and not folder.is_dir():
        raise NumGuardConfigError(
            f"`dirpath` must be a directory NumGuard can write events.jsonl and last_finite.ckpt into, got "
            f"{str(folder)!r}{origin}, which is a file: pass another dirpath"
        )
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise NumGuardConfigError(
            f"`dirpath` {str(folder)!r}{origin} cannot be made: {str(existing)!r} is a file: pass another dirpath"
        )
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise NumGuardConfigError(
            f"`dirpath` {str(folder)!r}{origin} is not writable ({str(existing)!r} does not let this process write "
            "into it): pass another dirpath"
        )
