"""The guard's series stay out of the user's metrics (issue 35).

Lightning's own tests assert the exact keys of ``trainer.callback_metrics``, ``logged_metrics`` and
``progress_bar_metrics`` (what ``EarlyStopping``, ``ModelCheckpoint(monitor=)``, ``ReduceLROnPlateau`` and tuning
integrations read), and the exact logger calls of code that logs (``LearningRateMonitor``, ``DeviceStatsMonitor``,
``self.log`` in ``on_train_start``). Each test here is one of those, run twice on a clean run, without the guard and
with ``NumGuardCallback()`` at its defaults: the dicts are equal, and so are the logger calls once the guard's own
calls are set aside. Those hold only ``numguard/`` tags, written beside Lightning's at its logging steps and step
numbers, as ``LearningRateMonitor`` writes (never merged into a call of Lightning's).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import DeviceStatsMonitor, LearningRateMonitor
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset
from pytorch_lightning.loggers.logger import Logger
from torch.utils.data import DataLoader

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning

Call = tuple[dict[str, float], int | None]


class SpyLogger(Logger):
    """A real Lightning logger that keeps every ``log_metrics`` call, as Lightning's tests mock them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    @property
    def name(self) -> str:
        return "spy"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.calls.append(({k: float(v) for k, v in metrics.items()}, step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class LoggingModel(BoringModel):
    """``self.log`` with every destination a user picks: step and epoch, progress bar, no logger; validation too."""

    def __init__(self, bad_step: int | None = None) -> None:
        super().__init__()
        self.bad_step = bad_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.step(batch)
        if self.global_step == self.bad_step:
            loss = loss + float("nan")
        self.log("a", loss)
        self.log("b", loss, on_step=True, on_epoch=True)
        self.log("c", loss, prog_bar=True)
        self.log("d", loss, logger=False)
        self.log("e", loss, on_step=False, on_epoch=True, prog_bar=True)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.step(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_f", loss, on_step=True, on_epoch=False)
        return {"x": loss}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=8)


class StepScheduled(LoggingModel):
    """A learning rate stepped every batch: ``LearningRateMonitor`` writes it at Lightning's logging steps."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ManualTwoOptimizers(BoringModel):
    """Manual optimization with two optimizers (a GAN's shape): two optimizer steps per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = torch.nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for name, layer, opt in zip(("loss_d", "loss_g"), (self.layer, self.other), self.optimizers()):
            loss = self.loss(layer(batch))
            self.log(name, loss, prog_bar=True)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=8)


class TrainStartModel(BoringModel):
    """Lightning's ``log_on_train_start``: a value logged in ``on_train_start``, written once, at step 0."""

    def on_train_start(self) -> None:
        self.log("foo", 123)


def _fit(model_class: Any, guarded: bool, *callbacks: pl.Callback, **kwargs: Any) -> tuple[pl.Trainer, Any]:
    """A fit of a new ``model_class()`` (made after seeding: both runs start from the same weights and data)."""
    pl.seed_everything(0, verbose=False)
    model = model_class(**kwargs.pop("model", {}))
    logger = kwargs.pop("logger", None) or SpyLogger()
    guard = [NumGuardCallback()] if guarded else []
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        default_root_dir=kwargs.pop("root"),
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=2,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=True,  # the progress-bar dict as a user's run has it
        enable_model_summary=False,
        logger=logger,
        callbacks=[*callbacks, *guard],
    )
    trainer = pl.Trainer(**{**settings, **kwargs})
    trainer.fit(model)
    return trainer, logger


def _values(d: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()}


def _dicts(trainer: pl.Trainer) -> list[dict[str, float]]:
    return [_values(trainer.callback_metrics), _values(trainer.logged_metrics), _values(trainer.progress_bar_metrics)]


def _guards(call: Call) -> bool:
    return all(k.startswith("numguard/") for k in call[0])


def _split(calls: list[Call]) -> tuple[list[Call], list[Call]]:
    """The calls of everything else, and the guard's own."""
    assert not any(_guards(c) is False and any(k.startswith("numguard/") for k in c[0]) for c in calls), calls
    return [c for c in calls if not _guards(c)], [c for c in calls if _guards(c)]


def _same(a: Any, b: Any) -> None:
    """Equal keys and steps, and values equal up to float noise (NaN where the other has NaN)."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), (sorted(a), sorted(b))
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), (a, b)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-9), (a, b)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("model_class", [LoggingModel, ManualTwoOptimizers])
def test_a_clean_run_leaves_lightnings_metric_dicts_as_it_found_them(tmp_path: Any, model_class: type) -> None:
    """The exact keys (and values) of ``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics``.

    Before: ``numguard/incidents``, ``numguard/skipped_steps``, ``numguard/rollbacks``, ``numguard/spikes``,
    ``numguard/grad_norm`` and the z-scores were in them on a clean run (the series went through ``pl_module.log``).
    """
    plain, plain_logger = _fit(model_class, False, root=tmp_path / "plain")
    guarded, guarded_logger = _fit(model_class, True, root=tmp_path / "guarded")
    guard = next(c for c in guarded.callbacks if isinstance(c, NumGuardCallback))
    assert guard.events == [] and guard.resolved_dirpath is not None  # control: the guard ran, and nothing happened
    assert not any(k.startswith("numguard/") or k in ("nan_incidents", "rollbacks") for d in _dicts(guarded) for k in d)
    _same(_dicts(guarded), _dicts(plain))
    theirs, ours = _split(guarded_logger.calls)
    _same(theirs, plain_logger.calls)
    assert ours, "control: the guard's series reached the logger"
    assert {"numguard/incidents", "numguard/grad_norm"} <= set(ours[0][0])


def test_learning_rate_monitors_calls_are_unchanged_and_the_series_share_its_steps(tmp_path: Any) -> None:
    """The guard writes as ``LearningRateMonitor`` does: to the loggers directly, at Lightning's logging steps."""
    _, plain_logger = _fit(StepScheduled, False, LearningRateMonitor(), root=tmp_path / "plain")
    _, guarded_logger = _fit(StepScheduled, True, LearningRateMonitor(), root=tmp_path / "guarded")
    theirs, ours = _split(guarded_logger.calls)
    _same(theirs, plain_logger.calls)
    lr_steps = [step for metrics, step in theirs if "lr-SGD" in metrics]
    loss_steps = [step for metrics, step in theirs if "a" in metrics]  # Lightning's own step metrics
    assert lr_steps == loss_steps == [1, 3, 5, 7]  # log_every_n_steps=2, 8 steps
    assert [step for _, step in ours] == lr_steps  # the same steps, the same step numbers


def test_device_stats_monitors_calls_are_unchanged(tmp_path: Any) -> None:
    """``DeviceStatsMonitor`` (CPU stats: values that vary run to run) makes the same calls, keys and steps."""

    def shape(calls: list[Call]) -> list[tuple[list[str], int | None]]:
        return [(sorted(metrics), step) for metrics, step in calls]

    _, plain_logger = _fit(LoggingModel, False, DeviceStatsMonitor(cpu_stats=True), root=tmp_path / "plain")
    _, guarded_logger = _fit(LoggingModel, True, DeviceStatsMonitor(cpu_stats=True), root=tmp_path / "guarded")
    theirs, _ = _split(guarded_logger.calls)
    assert any(any("cpu" in k for k in metrics) for metrics, _ in theirs)  # control: the monitor logged
    assert shape(theirs) == shape(plain_logger.calls)


def test_a_value_logged_on_train_start_is_written_once(tmp_path: Any) -> None:
    kwargs: dict[str, Any] = dict(limit_train_batches=1, limit_val_batches=0, log_every_n_steps=1)
    _, plain_logger = _fit(TrainStartModel, False, root=tmp_path / "plain", **kwargs)
    _, guarded_logger = _fit(TrainStartModel, True, root=tmp_path / "guarded", **kwargs)
    assert plain_logger.calls == [({"foo": 123.0, "epoch": 0.0}, 0)]  # Lightning's own assertion
    theirs, ours = _split(guarded_logger.calls)
    assert theirs == plain_logger.calls
    assert [step for _, step in ours] == [0, 1]  # one point per logging step, each in a call of its own


def test_after_an_incident_only_the_progress_bar_gains_the_guards_counts(tmp_path: Any) -> None:
    plain, _ = _fit(LoggingModel, False, root=tmp_path / "plain")
    with pytest.warns(NumGuardWarning, match="the loss is non-finite at step 2"):
        guarded, _ = _fit(LoggingModel, True, root=tmp_path / "guarded", model={"bad_step": 2})
    guard = next(c for c in guarded.callbacks if isinstance(c, NumGuardCallback))
    assert guard.counters["incidents"] == 1 and guard.counters["rollbacks"] == 1
    callback, logged, bar = (set(d) for d in _dicts(guarded))
    assert callback == set(plain.callback_metrics) and logged == set(plain.logged_metrics)
    assert bar == set(plain.progress_bar_metrics) | {"nan_incidents", "rollbacks"}
    assert all(math.isfinite(v) for d in _dicts(guarded) for v in d.values())  # the NaN step logged nothing
