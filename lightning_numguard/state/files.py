"""Files put in place whole: ``last_finite.ckpt`` (a file, or a folder a sharding strategy writes) is written under
a temporary name and then replaces the previous one, so that a whole checkpoint exists at every moment."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["remove", "replace"]


def remove(path: Path) -> None:
    """Delete a file or a folder, if there is one."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def replace(tmp: Path, final: Path) -> None:
    """Put ``tmp`` (a file or a folder) in place of ``final``: a file atomically; a folder by two renames, so
    that at every moment a whole checkpoint exists under ``final`` or under ``final.old``."""
    if not tmp.is_dir() and not final.is_dir():
        os.replace(tmp, final)
        return
    old = final.with_name(final.name + ".old")
    remove(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    remove(old)
