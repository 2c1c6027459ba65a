"""Zero-code attach: Lightning's callback-factory entry points add the guard when the environment asks for it.

Both Lightning packages call every function registered under their entry-point group
(``pytorch_lightning.callbacks_factory``, ``lightning.pytorch.callbacks_factory``) while a ``Trainer``
is built, and add the callbacks it returns. This package registers one factory per group. It is
opt-in, read from the environment of the process that builds the ``Trainer``
(:mod:`~lightning_numguard.doors.optin`, shared with the Fabric door):

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

from typing import Any

from lightning_numguard import _compat
from lightning_numguard.doors.optin import ENV_CONFIG, ENV_FLAG, build_requested, requested_init_args

__all__ = ["ENV_CONFIG", "ENV_FLAG", "lightning_callbacks", "pytorch_lightning_callbacks", "requested_init_args"]


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point of ``pytorch_lightning.callbacks_factory``: ``[NumGuardCallback(...)]`` if opted in, else ``[]``."""
    from lightning_numguard.doors.trainer.callback import NumGuardCallback

    return _callbacks(NumGuardCallback)


def lightning_callbacks() -> list[Any]:
    """Entry point of ``lightning.pytorch.callbacks_factory``: the ``lightning.pytorch`` class, else ``[]``."""
    from lightning_numguard.lightning import NumGuardCallback

    return _callbacks(NumGuardCallback)


def _callbacks(cls: type) -> list[Any]:
    from lightning_numguard.doors.trainer.callback import NumGuardCallback

    return build_requested(cls, _compat.callbacks_of_trainer_being_built, NumGuardCallback, "Trainer")
