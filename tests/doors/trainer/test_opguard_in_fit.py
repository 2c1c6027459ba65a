"""In a real fit the op guard's wrappers live exactly as long as the fit, exceptions included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_numguard import NumGuardCallback
from lightning_numguard.detect.opguard import patch as opguard_patch
from tests.helpers import FaultData, FaultModel, loader, trainer


class WrappedDuringStep(FaultModel):
    """Notes whether ``F.cross_entropy`` is wrapped in ``training_step``; raises at ``boom_step``."""

    def __init__(self, boom_step: int | None = None) -> None:
        super().__init__()
        self.boom_step = boom_step
        self.wrapped: list[bool] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.wrapped.append(F.cross_entropy is not ORIGINAL and len(opguard_patch.active_guards()) == 1)
        if self.global_step == self.boom_step:
            raise RuntimeError("boom")
        return nn.functional.mse_loss(self(batch["x"]), batch["y"])


ORIGINAL = F.cross_entropy


@pytest.mark.parametrize("boom_step", [None, 1])
def test_the_guarded_functions_are_wrapped_during_the_fit_only(tmp_path: Path, boom_step: Any) -> None:
    model = WrappedDuringStep(boom_step)
    t = trainer(tmp_path, [NumGuardCallback(recovery={"replay": False})], max_steps=3)
    if boom_step is None:
        t.fit(model, loader(FaultData()))
    else:
        with pytest.raises(RuntimeError, match="boom"):
            t.fit(model, loader(FaultData()))
    assert model.wrapped == [True] * (3 if boom_step is None else 2)
    assert F.cross_entropy is ORIGINAL and "gather" not in vars(torch.Tensor)
    assert opguard_patch._installed == {} and opguard_patch.active_guards() == []
