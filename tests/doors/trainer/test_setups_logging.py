"""What a discarded step logged never reaches monitors or loggers; a resumed run rolls back to its resumed state."""

from __future__ import annotations

import csv
import math
from typing import Any

import pytest
import torch
from pytorch_lightning import Callback
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import FaultData, FaultModel, loader, trainer


class LoggingModel(FaultModel):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss


class MetricsProbe(Callback):
    """Every value of ``callback_metrics`` and the progress bar, as seen at each batch start and epoch end."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def _look(self, trainer: Any) -> None:
        for d in (trainer.callback_metrics, trainer.progress_bar_metrics, trainer.logged_metrics):
            self.seen.extend(float(v) for v in d.values())

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self._look(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._look(trainer)


def test_a_rolled_back_nan_never_reaches_early_stopping_checkpoint_or_loggers(tmp_path):
    """The issue's scenario: before the fix EarlyStopping's check_finite stopped the run after one epoch."""
    stop = EarlyStopping(monitor="train_loss_epoch", check_on_train_epoch_end=True, patience=100)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss_epoch")
    probe = MetricsProbe()
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    t = trainer(
        tmp_path,
        [guard, stop, best, probe],
        max_epochs=3,
        enable_checkpointing=True,
        logger=CSVLogger(tmp_path, name="csv"),
        log_every_n_steps=1,
    )
    with pytest.warns(NumGuardWarning, match="batch"):
        t.fit(LoggingModel(), loader(FaultData(bad_batch=3, site="input")))
    assert guard.counters["rollbacks"] >= 1
    assert t.current_epoch == 3 and not stop.stopped_epoch  # the full max_epochs
    assert best.best_model_score is not None and math.isfinite(float(best.best_model_score))
    assert probe.seen and all(math.isfinite(v) for v in probe.seen)
    with open(t.logger.log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [float(r[k]) for r in rows for k in ("train_loss_step", "train_loss_epoch") if r.get(k)]
    assert len(logged) >= 3 * 8 - 1 and all(math.isfinite(v) for v in logged)


class ResumeProbe(Callback):
    """Optimizer and scheduler state right after the guard's first rollback (placed after the guard)."""

    def __init__(self, guard: NumGuardCallback) -> None:
        self.guard = guard
        self.after: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.after is None and self.guard.counters["rollbacks"]:
            opt, sched = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
            self.after = {"adam_state": len(opt.state), "last_epoch": sched.last_epoch, "lr": opt.param_groups[0]["lr"]}


# Lightning's remark on any mid-epoch resume (what this test does on purpose), not the guard's
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_resumed_run_rolls_back_to_its_resumed_optimizer_and_scheduler(tmp_path):
    torch.manual_seed(0)
    first = trainer(tmp_path / "a", [], max_steps=10)
    first.fit(FaultModel(), loader(FaultData(n=128)))
    ckpt = tmp_path / "step10.ckpt"
    first.save_checkpoint(ckpt)
    ref_lr = first.optimizers[0].param_groups[0]["lr"]

    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))  # default snapshot_every_n_steps=50
    probe = ResumeProbe(guard)
    t = trainer(tmp_path / "b", [guard, probe], max_steps=14, max_epochs=5)
    with pytest.warns(NumGuardWarning, match="body.0.weight"):
        t.fit(FaultModel(site="param", step=12), loader(FaultData(n=128)), ckpt_path=str(ckpt))
    assert guard.counters["rollbacks"] == 1
    assert probe.after is not None
    assert probe.after["adam_state"] > 0  # not a fresh Adam
    assert probe.after["last_epoch"] == 10  # StepLR as restored from the checkpoint
    assert probe.after["lr"] == pytest.approx(ref_lr)


class PlateauModel(LoggingModel):
    """ReduceLROnPlateau on the step-logged ``train_loss``: any step not better than the best halves the LR."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "monitor": "train_loss"}}


def test_reduce_lr_on_plateau_is_not_stepped_by_a_discarded_step(tmp_path):
    """A NaN batch rolled back leaves the LR schedule of a run that never had that batch.

    Before: the scheduler was stepped for the discarded step with the previous step's value, counted it as a
    step without improvement and halved the LR once more.
    """
    torch.manual_seed(0)
    ref_model = PlateauModel()
    ref = trainer(tmp_path / "ref", [], max_epochs=1)
    ref.fit(ref_model, loader(FaultData(omit_batch=3)))
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    torch.manual_seed(0)
    model = PlateauModel()
    t = trainer(tmp_path / "ng", [guard], max_epochs=1)
    with pytest.warns(NumGuardWarning):
        t.fit(model, loader(FaultData(bad_batch=3, site="input")))
    ref_lr = ref.optimizers[0].param_groups[0]["lr"]
    assert ref_lr < 0.05  # the reference run did cut its LR: the schedule is exercised
    assert t.optimizers[0].param_groups[0]["lr"] == ref_lr
