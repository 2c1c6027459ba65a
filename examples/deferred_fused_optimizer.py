"""``sync_mode="deferred"`` with a fused optimizer: no host read per step, a NaN step skipped on the device.

Every step's flags are packed on the device and read one step later, together with the next step's work, so the
host never waits for the device on the guard's account. A bad step is skipped on the device through the fused
optimizer's ``found_inf`` (as ``torch.amp.GradScaler`` does): the optimizer must be fused (``fused=True``); a
foreach or for-loop one ignores ``found_inf`` and is refused at fit start. Here the loss of step 5 is made NaN;
the guard names it one step late and the weights stay finite. Runs as written::

    python examples/deferred_fused_optimizer.py          # 200 steps
    python examples/deferred_fused_optimizer.py --fast   # 12 steps (the test suite runs this)

On a GPU the same code runs with ``accelerator="gpu"`` and ``precision="bf16-mixed"``.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_numguard import NumGuardCallback

BAD_STEP = 5


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        return loss * float("nan") if self.global_step == BAD_STEP else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)  # fused: it honours found_inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="12 steps (the test suite's run)")
    parser.add_argument("--dir", default=None, help="output folder (default: a new temporary folder)")
    args = parser.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="numguard-deferred-")  # never the working directory
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :4].sum(-1)), batch_size=32)
    guard = NumGuardCallback(action="skip", sync_mode="deferred")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=12 if args.fast else 200,
        callbacks=[guard],
        default_root_dir=folder,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, data)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    for e in guard.events:
        late = f", read at step {e['details'].get('read_at_step')}" if e["details"].get("deferred") else ""
        print(f"step {e['step']}: {e['kind']} in {e['where']} -> {e['action']}{late}")
    print(f"counters: {guard.counters}; weights finite: {finite}")
    print(f"files in: {folder}")


if __name__ == "__main__":
    main()
