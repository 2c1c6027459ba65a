"""The guard configured from a YAML file through ``LightningCLI``: ``examples/lightning_cli.yaml``.

Runs as written (from the repository's root)::

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml --trainer.max_steps 6   # fast

The YAML lists ``lightning_numguard.NumGuardCallback`` under ``trainer.callbacks`` with its arguments; LightningCLI
checks each against its type while parsing (``snapshot_every_n_steps: -3`` or ``spikes: {overflow_headroom: 0.5}`` is
refused before anything is built, naming the argument). ``python examples/lightning_cli.py fit --help`` lists
every argument of the guard with its documentation. The model makes its loss NaN at ``bad_step``.
"""

from __future__ import annotations

import tempfile

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Model(pl.LightningModule):
    def __init__(self, bad_step: int = 3, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss + float("nan") if self.global_step == self.hparams.bad_step else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(-1)), batch_size=self.batch_size)


if __name__ == "__main__":
    # logs and the guard's files go to a new temporary folder unless --trainer.default_root_dir names one
    LightningCLI(
        Model,
        Data,
        save_config_callback=None,
        trainer_defaults={"default_root_dir": tempfile.mkdtemp(prefix="numguard-cli-")},
    )
