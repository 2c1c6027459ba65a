"""Forward hooks and op-guard mode of ``NumGuardCallback``: never left behind or stacked, inert in copies."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from lightning_numguard import NumGuardCallback
from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.detect.opguard import patch as opguard_patch
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import EVERY_CHECK, FaultData, FaultModel, loader, trainer


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _opguards_active() -> list[Any]:
    # the op guard intercepts its functions itself (core.opguard.patch), not through the mode stack
    return [g for g in opguard_patch.active_guards() if isinstance(g, OpGuard)]


class _Census(pl.Callback):
    """Counts, during training, the module hooks on the model and the op guards on the mode stack."""

    def __init__(self) -> None:
        self.hooks: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.hooks.append(_hook_count(pl_module))


class CensusModel(FaultModel):
    """Records how many op guards are active while ``training_step`` runs."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.modes_in_step: list[int] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.modes_in_step.append(len(_opguards_active()))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(batch["x"])


class BoomModel(FaultModel):
    """``training_step`` raises at global step 2, while the op guard and the hooks are live."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch["x"])  # watched modules' hooks fire first
        if self.global_step == 2:
            raise RuntimeError("boom in training_step at step 2")
        return nn.functional.mse_loss(out, batch["y"])


@pytest.fixture(autouse=True)
def _no_mode_leak() -> Any:
    assert _get_current_function_mode_stack() == []
    yield
    assert _get_current_function_mode_stack() == [], "a TorchFunctionMode leaked out of the test"


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_no_hooks_left_after_fit(tmp_path: Path) -> None:
    model = CensusModel()
    census = _Census()
    before = _hook_count(model)
    trainer(tmp_path, [NumGuardCallback(check=EVERY_CHECK, recovery={"replay": False}), census], max_steps=3).fit(
        model, loader(FaultData())
    )
    # control: the guard's hooks and op guard were live during training
    assert census.hooks
    assert min(census.hooks) > before
    assert model.modes_in_step == [1, 1, 1]
    # and nothing is left afterwards
    for name, module in model.named_modules():
        assert not module._forward_hooks, name
        assert not module._forward_pre_hooks, name
    assert _hook_count(model) == before
    assert _opguards_active() == []


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_second_fit_does_not_stack_hooks(tmp_path: Path) -> None:
    model = CensusModel()
    cb = NumGuardCallback(check=EVERY_CHECK, recovery={"replay": False})
    first, second = _Census(), _Census()
    trainer(tmp_path, [cb, first], max_steps=2).fit(model, loader(FaultData()))
    tr = trainer(tmp_path, [cb], max_steps=2)
    tr.validate(model, loader(FaultData()), verbose=False)  # setup/teardown with stage="validate"
    trainer(tmp_path, [cb, second], max_steps=2).fit(model, loader(FaultData()))
    assert first.hooks[0] > 0
    assert second.hooks == first.hooks
    assert model.modes_in_step == [1, 1, 1, 1]
    assert _hook_count(model) == 0


def test_second_fit_still_detects(tmp_path: Path) -> None:
    """The re-registered hooks are live: a module fault in the second fit is named."""
    cb = NumGuardCallback(action="skip", check=EVERY_CHECK, recovery={"replay": False})
    model = FaultModel()
    trainer(tmp_path, [cb], max_steps=2).fit(model, loader(FaultData()))
    model.site, model.fault_step = "output", 3  # a new Trainer counts steps from 0 again
    with pytest.warns(NumGuardWarning, match=r"^NumGuard: .+ at step 3 on rank 0") as records:
        trainer(tmp_path, [cb], max_steps=5).fit(model, loader(FaultData()))
    warned = [str(r.message) for r in records if issubclass(r.category, NumGuardWarning)]
    assert re.match(r"NumGuard: module `body\.1` produced the first non-finite output at step 3", warned[0])
    first = [e for e in cb.events if e["kind"] == "nonfinite_output"]
    assert [(e["step"], e["where"]) for e in first] == [(3, ["body.1"])]
    assert _hook_count(model) == 0


def test_exception_in_training_step_removes_hooks_and_mode(tmp_path: Path) -> None:
    model = BoomModel()
    census = _Census()
    with pytest.raises(RuntimeError, match="boom in training_step at step 2"):
        trainer(tmp_path, [NumGuardCallback(check=EVERY_CHECK, recovery={"replay": False}), census], max_steps=5).fit(
            model, loader(FaultData())
        )
    assert len(census.hooks) == 3
    assert min(census.hooks) > 0
    assert _hook_count(model) == 0
    assert _get_current_function_mode_stack() == []
    # the model trains normally afterwards, without the guard
    trainer(tmp_path, [], max_steps=1).fit(FaultModel(), loader(FaultData()))


class _EMA(pl.Callback):
    """An EMA-style callback: deep-copies the model during training and runs the copy's forward.

    The copy's ``body.1`` is armed, so its outputs are NaN: if the copied hooks still recorded
    into the guard, the guard would report an incident the real model never had.
    """

    def __init__(self) -> None:
        self.ema: nn.Module | None = None
        self.copies_had_hooks = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is None:
            self.ema = copy.deepcopy(pl_module)
            self.copies_had_hooks = _hook_count(self.ema) > 0
            self.ema.body[1].armed = True
        with torch.enable_grad():
            self.ema(batch["x"])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.ema is not None
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), pl_module.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)


def test_deepcopy_of_the_model_does_not_record(tmp_path: Path) -> None:
    cb = NumGuardCallback(action="skip", check=EVERY_CHECK, recovery={"replay": False})
    ema = _EMA()
    model = FaultModel()
    trainer(tmp_path, [cb, ema], max_steps=4).fit(model, loader(FaultData()))
    assert ema.copies_had_hooks, "control: deepcopy carried the guard's hooks into the copy"
    assert ema.ema is not None
    assert not torch.isfinite(ema.ema(torch.randn(2, 8))).all(), "control: the copy's output is NaN"
    assert cb.events == []
    assert cb.counters["incidents"] == 0
    assert _hook_count(model) == 0
