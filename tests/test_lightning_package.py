"""The guard under the ``lightning`` package (``import lightning.pytorch as L``), with ``pytorch_lightning`` installed too.

Real ``L.Trainer`` fits, a real ``lightning.pytorch.cli.LightningCLI`` reading a YAML file, the TensorBoard
event files of ``lightning.pytorch.loggers.TensorBoardLogger`` read back, and a checkpoint written under one
package resumed under the other.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning.pytorch", reason="the `lightning` package is in the dev extra")
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

import lightning_numguard  # noqa: E402
from lightning_numguard.errors import NumGuardWarning  # noqa: E402
from lightning_numguard.lightning import NumGuardCallback  # noqa: E402
from tests.helpers import quiet_trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The number of training batches .* logging interval")


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when ``args`` is given while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["numguard-lightning-test"])


def _model_class(base: type) -> type:
    """The same small model on either package's ``LightningModule``: NaN loss at global step ``bad_step``."""

    class NaNLossModel(base):  # type: ignore[misc, valid-type]
        def __init__(self, bad_step: int = 3) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
            self.bad_step = bad_step

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            return loss + float("nan") if self.global_step == self.bad_step else loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return NaNLossModel


LModel = _model_class(L.LightningModule)
PLModel = _model_class(pl.LightningModule)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)


def test_the_class_is_a_lightning_callback_with_the_shared_state_key() -> None:
    assert issubclass(NumGuardCallback, L.Callback)
    assert issubclass(NumGuardCallback, lightning_numguard.NumGuardCallback)  # one implementation
    assert NumGuardCallback().state_key == lightning_numguard.NumGuardCallback().state_key == "NumGuardCallback"
    assert "`NumGuardCallback` from `lightning_numguard.lightning`" in (NumGuardCallback.__doc__ or "")
    assert not issubclass(lightning_numguard.NumGuardCallback, L.Callback)  # hence the second import path


def test_rollback_and_tensorboard_text_under_l_trainer(tmp_path: Path) -> None:
    cb = NumGuardCallback(action="rollback", snapshot_every_n_steps=1)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = quiet_trainer(
        trainer_class=L.Trainer, default_root_dir=tmp_path, logger=logger, devices=1, max_epochs=1, log_every_n_steps=50
    )
    trainer.callbacks.append(cb)  # appended after construction: the same as callbacks=[cb] for the guard
    model = LModel(bad_step=3)
    with pytest.warns(NumGuardWarning, match=r"the loss is non-finite at step 3"):
        trainer.fit(model, _data())

    assert [(e["kind"], e["step"], e["action"]) for e in cb.events] == [("nonfinite_loss", 3, "rollback")]
    assert cb.counters["rollbacks"] == 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert cb.resolved_dirpath == Path(logger.log_dir) / "numguard"
    assert (cb.resolved_dirpath / "events.jsonl").read_text().count("\n") == 1

    ea = EventAccumulator(logger.log_dir)
    ea.Reload()
    texts = [
        tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in ea.Tensors("numguard/events/text_summary")
    ]
    assert len(texts) == 1 and "**nonfinite_loss** (step 3" in texts[0], texts
    # the incident's step (8 steps: Lightning's logging steps, every 50, are never reached)
    assert [(e.step, e.value) for e in ea.Scalars("numguard/rollbacks")] == [(3, 1.0)]
    # the run's picture, once, at the end of the fit (issue 27)
    assert ea.Tags()["images"] == ["numguard/run"]
    assert len(ea.Images("numguard/run")) == 1


def _yaml(tmp_path: Path, class_path: str) -> Path:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        f"""\
trainer:
  default_root_dir: {tmp_path}
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  max_steps: 2
  callbacks:
    - class_path: {class_path}
      init_args: {{action: skip, snapshot_every_n_steps: 5, check: [inputs, loss, grads]}}
"""
    )
    return cfg


def test_lightning_cli_yaml_parses_and_runs(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, "lightning_numguard.lightning.NumGuardCallback")
    cli = LightningCLI(
        BoringModel,
        BoringDataModule,
        args=["fit", "--config", str(cfg)],
        save_config_callback=None,
        seed_everything_default=False,
    )
    (guard,) = [c for c in cli.trainer.callbacks if isinstance(c, NumGuardCallback)]
    assert (guard.action, guard.snapshot_every_n_steps, guard.check) == ("skip", 5, ["inputs", "loss", "grads"])
    assert cli.trainer.state.finished and cli.trainer.global_step == 2
    assert guard.events == []


def test_lightning_cli_refuses_the_pytorch_lightning_class(tmp_path: Path) -> None:
    """Why the second import path exists: ``L``'s CLI wants a ``lightning.pytorch.Callback``."""
    cfg = _yaml(tmp_path, "lightning_numguard.NumGuardCallback")
    with pytest.raises(SystemExit):
        LightningCLI(BoringModel, BoringDataModule, args=["--config", str(cfg)], run=False, save_config_callback=None)


def test_checkpoint_state_moves_between_the_two_packages(tmp_path: Path) -> None:
    """A checkpoint written under ``L.Trainer`` resumes under ``pl.Trainer``, the guard's counters included."""
    l_cb = NumGuardCallback(action="rollback")
    # no ModelCheckpoint: its state would not follow the changed default_root_dir (Lightning warns), and is not the point
    l_trainer = quiet_trainer([l_cb], L.Trainer, default_root_dir=tmp_path / "l", devices=1, max_epochs=1)
    with pytest.warns(NumGuardWarning):
        l_trainer.fit(LModel(bad_step=3), _data())
    ckpt = tmp_path / "l.ckpt"
    l_trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=True)["callbacks"]["NumGuardCallback"]["counters"]["rollbacks"] == 1

    l_window = _valid(l_cb.state_dict())
    pl_cb = lightning_numguard.NumGuardCallback(action="rollback")
    pl_trainer = quiet_trainer([pl_cb], pl.Trainer, default_root_dir=tmp_path / "pl", devices=1, max_epochs=2)
    pl_trainer.fit(PLModel(bad_step=-1), _data(), ckpt_path=ckpt)
    assert l_trainer.global_step == 8 and pl_trainer.global_step == 16  # it trained on from the checkpoint
    assert pl_cb.counters == l_cb.counters and pl_cb.counters["rollbacks"] == 1
    # the state moved whole; the spike window then took the second fit's 8 steps on top of the first's, and the
    # events files name the first run's, then the resumed run's own
    moved = ("spike", "events_files")
    assert {k: v for k, v in pl_cb.state_dict().items() if k not in moved} == {
        k: v for k, v in l_cb.state_dict().items() if k not in moved
    }
    assert pl_cb.state_dict()["events_files"] == [
        *l_cb.state_dict()["events_files"],
        str(tmp_path / "pl" / "numguard" / "events.jsonl"),
    ]
    assert l_window is not None and min(l_window) > 0
    assert _valid(pl_cb.state_dict()) == [n + 8 for n in l_window]


def _valid(state: dict[str, Any]) -> list[int] | None:
    """The values each row of the spike window holds (loss, gradient norm), from the callback's public state."""
    window = (state.get("spike") or {}).get("window")
    return None if not window else [sum(v is not None for v in row) for row in window["values"]]
