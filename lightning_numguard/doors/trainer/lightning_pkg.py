"""``NumGuardCallback`` for users of the ``lightning`` package (``import lightning.pytorch as L``).

The ``pytorch_lightning`` and ``lightning.pytorch`` distributions ship the same code under two
names, and their ``Callback`` classes are distinct: ``L.Trainer`` runs any object with the hooks,
but ``lightning.pytorch.cli.LightningCLI`` refuses a class that does not subclass
``lightning.pytorch.Callback`` ("does not correspond to a subclass of Callback"). This module gives
those users the same callback with that base::

    import lightning.pytorch as L
    from lightning_numguard.lightning import NumGuardCallback

    trainer = L.Trainer(callbacks=[NumGuardCallback(action="rollback")])

and in a ``LightningCLI`` YAML file ``class_path: lightning_numguard.lightning.NumGuardCallback``.

There is one implementation. The class below adds ``lightning.pytorch.Callback`` as a second base of
:class:`lightning_numguard.doors.trainer.callback.NumGuardCallback`, whose code reaches the trainer only
by duck typing (the attributes both packages share) and whose reporting recognises either package's
``TensorBoardLogger``. Its ``state_key`` is ``"NumGuardCallback"`` too, so a checkpoint written under
one package resumes under the other with the guard's counters and quarantine.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback as _LightningCallback

from lightning_numguard.doors.trainer import callback as _numguard

__all__ = ["NumGuardCallback"]


# mypy compares the hook annotations of the two bases (pytorch_lightning vs lightning.pytorch types); at
# runtime both packages call the hooks with their own Trainer and module, which the implementation duck-types.
class NumGuardCallback(_numguard.NumGuardCallback, _LightningCallback):  # type: ignore[misc]
    # The docstring (the contract and LightningCLI's --help) is the implementation's, with this import path.
    __doc__ = (_numguard.NumGuardCallback.__doc__ or "").replace(
        "from pytorch_lightning import Trainer\n        from lightning_numguard import NumGuardCallback",
        "from lightning.pytorch import Trainer\n        from lightning_numguard.lightning import NumGuardCallback",
    )


# the public import path (LightningCLI's class_path, reprs, and the attach test's class names)
NumGuardCallback.__module__ = "lightning_numguard.lightning"
