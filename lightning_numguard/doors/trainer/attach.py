"""Zero-code attach: Lightning's callback-factory entry points add the guard when the environment asks for it.

Both Lightning packages call every function registered under their entry-point group
(``pytorch_lightning.callbacks_factory``, ``lightning.pytorch.callbacks_factory``) while a ``Trainer``
is built, and add the callbacks it returns. This package registers one factory per group. It is
opt-in, read from the environment of the process that builds the ``Trainer``:

====================================  ==========================================================
``NUMGUARD=1`` (or true/yes/on)       ``NumGuardCallback()`` with its defaults
``NUMGUARD_CONFIG=path.yaml``         ``NumGuardCallback(**init_args)`` from that YAML file: a
                                      mapping of init args, or a LightningCLI-style entry
                                      ``{class_path: ..., init_args: {...}}``
``NUMGUARD=0`` (or false/no/off)      nothing, even with ``NUMGUARD_CONFIG`` set
neither                               nothing
====================================  ==========================================================

A ``Trainer`` that already holds a ``NumGuardCallback`` (passed by the user, from a LightningCLI
YAML file) gets no second one. A bad value or file raises
:class:`~lightning_numguard.errors.NumGuardConfigError` naming the variable or the file.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_numguard import _compat
from lightning_numguard.errors import NumGuardConfigError

__all__ = ["ENV_CONFIG", "ENV_FLAG", "lightning_callbacks", "pytorch_lightning_callbacks", "requested_init_args"]

log = logging.getLogger(__name__)

ENV_FLAG = "NUMGUARD"
ENV_CONFIG = "NUMGUARD_CONFIG"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point of ``pytorch_lightning.callbacks_factory``: ``[NumGuardCallback(...)]`` if opted in, else ``[]``."""
    from lightning_numguard.doors.trainer.callback import NumGuardCallback

    return _callbacks(NumGuardCallback)


def lightning_callbacks() -> list[Any]:
    """Entry point of ``lightning.pytorch.callbacks_factory``: the ``lightning.pytorch`` class, else ``[]``."""
    from lightning_numguard.lightning import NumGuardCallback

    return _callbacks(NumGuardCallback)


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
            f"{where} must hold a mapping of NumGuardCallback init args (e.g. `action: rollback`), "
            f"got a {type(raw).__name__}."
        )
    return dict(raw)


def _callbacks(cls: type) -> list[Any]:
    init_args = requested_init_args(os.environ)
    if init_args is None:
        return []
    from lightning_numguard.doors.trainer.callback import NumGuardCallback

    present = _compat.callbacks_of_trainer_being_built() or []
    if any(isinstance(cb, NumGuardCallback) for cb in present):
        log.info("numguard: the Trainer already has a NumGuardCallback; %s adds no second one", ENV_FLAG)
        return []
    source = os.environ.get(ENV_CONFIG) or f"{ENV_FLAG}={os.environ.get(ENV_FLAG)}"
    try:
        callback = cls(**init_args)
    except NumGuardConfigError as err:
        raise NumGuardConfigError(f"{err} (from {ENV_CONFIG}={source!r})") from None
    except TypeError as err:  # an argument NumGuardCallback does not have
        raise NumGuardConfigError(
            f"NumGuard: {ENV_CONFIG}={source!r} names an argument NumGuardCallback does not take ({err}); "
            "the arguments are listed in NumGuardCallback's docstring and docs/reference.md."
        ) from None
    log.info("numguard: attached %s from %s", cls.__module__ + "." + cls.__qualname__, source)
    return [callback]
