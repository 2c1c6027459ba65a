"""End of fit: a NaN found only by the last check repairs what is broken, without throwing the run away."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import FaultData, FaultModel, loader, trainer

STEPS = 8


class FrozenLayerModel(FaultModel):
    """A frozen layer the loss never touches; ``poison`` goes NaN after the last optimizer step."""

    def __init__(self, poison: str) -> None:
        super().__init__()
        self.unused = nn.Linear(2, 2)
        self.unused.requires_grad_(False)
        self.poison = poison

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.poison and self.global_step == STEPS:
            with torch.no_grad():
                self.get_parameter(self.poison)[0, 0] = float("nan")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        return opt


def _fit(tmp_path, model, guard=None):
    torch.manual_seed(0)
    t = trainer(tmp_path, [guard] if guard else [], max_steps=STEPS)
    t.fit(model, loader(FaultData()))
    return model


def test_a_nan_in_a_frozen_unused_layer_keeps_the_training(tmp_path):
    """Before: the end-of-training check restored the fit-start snapshot and every step was lost."""
    torch.manual_seed(1)
    init = FrozenLayerModel("").state_dict()
    ref = FrozenLayerModel("")
    ref.load_state_dict(init)
    _fit(tmp_path / "ref", ref)
    got = FrozenLayerModel("unused.weight")
    got.load_state_dict(init)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="unused.weight"):
        _fit(tmp_path / "ng", got, guard)
    for key, value in ref.state_dict().items():
        assert torch.equal(value, got.state_dict()[key]), key  # trained tensors kept, the bad one restored
    (event,) = guard.events
    assert event["details"]["restored_only"] == ["unused.weight"] and event["details"]["steps_given_up"] == 0
    assert "no step given up" in event["message"]


def test_a_nan_in_a_trained_layer_says_how_many_steps_the_rollback_gives_up(tmp_path):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="body.0.weight"):
        model = _fit(tmp_path, FrozenLayerModel("body.0.weight"), guard)
    (event,) = guard.events
    assert event["action"] == "rollback" and event["details"]["steps_given_up"] == STEPS
    assert f"{STEPS} steps given up" in event["message"]
    assert torch.isfinite(model.body[0].weight).all()
