"""The opt-in from the environment, shared by every zero-code door: ``NUMGUARD`` and ``NUMGUARD_CONFIG``.

The Trainer's callback factories (:mod:`~lightning_numguard.doors.trainer.attach`) and Fabric's
(:mod:`~lightning_numguard.doors.fabric.attach`) read the same two variables, in the process that builds the
``Trainer`` or the ``Fabric``:

====================================  ==========================================================
``NUMGUARD=1`` (or true/yes/on)       the guard with its defaults
``NUMGUARD_CONFIG=path.yaml``         the guard's init args from that YAML file: a mapping of
                                      init args, or a LightningCLI-style entry
                                      ``{class_path: ..., init_args: {...}}`` (its ``init_args``)
``NUMGUARD=0`` (or false/no/off)      nothing, even with ``NUMGUARD_CONFIG`` set
neither                               nothing
====================================  ==========================================================

A bad value or file raises :class:`~lightning_numguard.errors.NumGuardConfigError` naming the variable or the file.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_numguard.errors import NumGuardConfigError

__all__ = ["ENV_CONFIG", "ENV_FLAG", "build_requested", "requested_init_args"]

log = logging.getLogger(__name__)

ENV_FLAG = "NUMGUARD"
ENV_CONFIG = "NUMGUARD_CONFIG"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def requested_init_args(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The init args the environment asks for, or ``None`` when the guard is not requested.

    Raises:
        NumGuardConfigError: ``NUMGUARD`` is not a yes/no value, or the ``NUMGUARD_CONFIG`` file is
            missing, not YAML, or not a mapping.
    """
    flag = env.get(ENV_FLAG)
    config = env.get(ENV_CONFIG, "").strip()
    if flag is not None and flag.strip().lower() not in _ON + _OFF:
        raise NumGuardConfigError(
            f"NumGuard: environment variable {ENV_FLAG}={flag!r} is not understood; allowed: "
            f"{', '.join(repr(v) for v in _ON + _OFF[1:])} (unset it to leave the guard off)."
        )
    if flag is not None and flag.strip().lower() in _OFF:
        return None
    if config:
        return _read_config(Path(config))
    return {} if flag is not None else None


def build_requested(cls: type, present: Callable[[], list[Any] | None], kind: type, owner: str) -> list[Any]:
    """``[cls(**init_args)]`` when the environment asks for the guard, else ``[]``.

    ``present``: the callbacks the ``owner`` (``"Trainer"``, ``"Fabric"``) being built already holds (``None``: not
    known), asked only when the guard is requested; one that is a ``kind`` already there means no second guard.

    Raises:
        NumGuardConfigError: what :func:`requested_init_args` raises, and an argument ``cls`` does not take or
            refuses, naming the variable or file it came from.
    """
    init_args = requested_init_args(os.environ)
    if init_args is None:
        return []
    if any(isinstance(cb, kind) for cb in present() or []):
        log.info("numguard: the %s already has a %s; %s adds no second one", owner, kind.__name__, ENV_FLAG)
        return []
    source = os.environ.get(ENV_CONFIG) or f"{ENV_FLAG}={os.environ.get(ENV_FLAG)}"
    try:
        guard = cls(**init_args)
    except NumGuardConfigError as err:
        raise NumGuardConfigError(f"{err} (from {ENV_CONFIG}={source!r})") from None
    except TypeError as err:  # an argument the guard does not have
        raise NumGuardConfigError(
            f"NumGuard: {ENV_CONFIG}={source!r} names an argument {kind.__name__} does not take ({err}); "
            "the arguments are listed in its docstring and docs/reference.md."
        ) from None
    log.info("numguard: attached %s from %s", cls.__module__ + "." + cls.__qualname__, source)
    return [guard]


def _read_config(path: Path) -> dict[str, Any]:
    import yaml

    class Loader(yaml.SafeLoader):
        """``yaml.safe_load``'s loader, reading ``1.0e6`` and ``1e18`` as floats (YAML 1.2, as LightningCLI does)."""

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+.0123456789"),
    )
    where = f"NumGuard: {ENV_CONFIG}={str(path)!r}"
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # a SafeLoader subclass
    except OSError as err:
        raise NumGuardConfigError(f"{where} cannot be read ({err.strerror}); point it at a YAML file.") from None
    except yaml.YAMLError as err:
        raise NumGuardConfigError(f"{where} is not valid YAML: {err}") from None
    if raw is None:
        return {}
    if isinstance(raw, Mapping) and set(raw) <= {"class_path", "init_args"} and "init_args" in raw:
        raw = raw["init_args"] or {}  # a LightningCLI callback entry, pasted as it is
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise NumGuardConfigError(
            f"{where} must hold a mapping of NumGuardCallback init args (e.g. `action: rollback`; the Fabric "
            f"NumGuard takes the same), got a {type(raw).__name__}."
        )
    return dict(raw)
