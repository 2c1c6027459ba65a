"""The rest of the Trainer: each setup trains bitwise as without the guard when nothing is wrong, and survives a NaN."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    OnExceptionCheckpoint,
    StochasticWeightAveraging,
)
from pytorch_lightning.loggers import CSVLogger

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import FaultData, FaultModel, all_finite, loader, trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:pytorch_lightning")


class SetupModel(FaultModel):
    def __init__(self, none_at: int | None = None, as_dict: bool = False) -> None:
        super().__init__()
        self.none_at, self.as_dict = none_at, as_dict

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        if batch_idx == self.none_at:
            return None  # Lightning skips this batch
        return {"loss": loss, "detached": loss.detach()} if self.as_dict else loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch["x"]), batch["y"]))


def _setup(name: str, tmp: Any) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    """(Trainer kwargs, extra callbacks, model kwargs) of each setup."""
    return {
        "lr_monitor": ({"logger": CSVLogger(tmp), "log_every_n_steps": 1}, [LearningRateMonitor("step")], {}),
        "swa": ({"max_epochs": 3}, [StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)], {}),
        "save_last": ({"enable_checkpointing": True}, [ModelCheckpoint(dirpath=tmp / "ck", save_last=True)], {}),
        "on_exception": ({"enable_checkpointing": True}, [OnExceptionCheckpoint(dirpath=tmp / "exc")], {}),
        "val_mid_epoch": ({"val_check_interval": 0.5, "limit_val_batches": 2}, [], {}),
        "limit_train_batches": ({"limit_train_batches": 6, "max_epochs": 2}, [], {}),
        "max_time": ({"max_time": "00:00:05:00"}, [], {}),
        "fit_twice": ({}, [], {}),
        "step_returns_none": ({}, [], {"none_at": 1}),
        "step_returns_dict": ({}, [], {"as_dict": True}),
    }[name]


SETUPS = [
    "lr_monitor",
    # Lightning's own remarks on these setups, not the guard's: SWA on FaultModel's per-step scheduler, and
    # OnExceptionCheckpoint's default ckpt_path="last" in a fit that starts from nothing
    pytest.param("swa", marks=pytest.mark.filterwarnings("ignore:SWA is currently only supported every epoch")),
    "save_last",
    pytest.param(
        "on_exception",
        marks=[
            pytest.mark.filterwarnings("ignore:`.fit.ckpt_path=None.` was called without a model"),
            pytest.mark.filterwarnings("ignore:.fit.ckpt_path=.last.. is set, but there is no last checkpoint"),
        ],
    ),
    "val_mid_epoch",
    "limit_train_batches",
    "max_time",
    "fit_twice",
    "step_returns_none",
    "step_returns_dict",
]


def _run(tmp: Any, name: str, guard: NumGuardCallback | None, bad_batch: int | None) -> tuple[SetupModel, Any]:
    kwargs, extra, model_kwargs = _setup(name, tmp)
    torch.manual_seed(0)
    model = SetupModel(**model_kwargs)
    callbacks = ([guard] if guard is not None else []) + extra
    t = trainer(tmp, callbacks, **kwargs)
    data = FaultData(bad_batch=bad_batch, site="input")
    val = loader(FaultData(n=16, seed=1))
    t.fit(model, loader(data), val)
    if name == "fit_twice":
        t.fit_loop.max_epochs = 2
        t.fit(model, loader(data), val)
    return model, t


@pytest.mark.parametrize("name", SETUPS)
def test_a_clean_run_is_bitwise_the_run_without_the_guard(tmp_path, name):
    ref, ref_t = _run(tmp_path / "ref", name, None, None)
    got, got_t = _run(tmp_path / "ng", name, NumGuardCallback(dirpath=str(tmp_path / "ng" / "events")), None)
    assert got_t.global_step == ref_t.global_step
    for key, value in ref.state_dict().items():
        assert torch.equal(value, got.state_dict()[key]), key


@pytest.mark.parametrize("name", SETUPS)
def test_a_nan_batch_is_survived(tmp_path, name):
    guard = NumGuardCallback(dirpath=str(tmp_path / "events"))
    with pytest.warns(NumGuardWarning, match=r"batch\['x'\]"):
        model, t = _run(tmp_path, name, guard, bad_batch=3)
    assert guard.counters["rollbacks"] >= 1
    assert all_finite(model.state_dict())
    assert all(torch.isfinite(v).all() for v in t.callback_metrics.values())
    if name == "save_last":
        saved = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
        assert all_finite(saved["state_dict"])
