"""FSDP2 with the guard, on CPU processes: a NaN written into one rank's shard of a weight, rolled back.

Two processes (gloo) under Lightning's ``ModelParallelStrategy``; ``configure_model`` shards each linear and the
root with ``fully_shard`` over the data-parallel mesh. At step 3, rank 1 writes NaN into row 0 of its local shard
of ``fc1.weight``: the guard's next read sees it on that rank (one all-reduce of the packed flags: every rank
decides the same), names the parameter and the rank, and rolls every rank back to the last verified-finite
snapshot, in which each rank holds only its own shards (no gather). Runs as written::

    python examples/fsdp2_nan_in_a_shard.py            # 40 steps
    python examples/fsdp2_nan_in_a_shard.py --fast     # 8 steps (the test suite runs this)

Lightning launches the second process itself (it runs this script again with ``LOCAL_RANK=1``). No GPU needed; on
GPUs, drop ``accelerator="cpu"`` and the gloo-specific settings.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from datetime import timedelta

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_numguard import NumGuardCallback

FAULT_STEP, FAULT_RANK = 3, 1


class ShardedMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 1)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]  # type: ignore[index]
        for layer in (self.fc1, self.fc2):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if self.global_step == FAULT_STEP and self.global_rank == FAULT_RANK:
            with torch.no_grad():
                self.fc1.weight.to_local()[0] = float("nan")  # type: ignore[operator]  # this rank's shard only

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.global_rank)  # each rank its own data
        x = torch.randn(512, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sum(-1)), batch_size=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="8 steps (the test suite's run)")
    parser.add_argument("--dir", default=None, help="output folder (default: a new temporary folder)")
    args = parser.parse_args()
    # never the working directory; one folder for both processes (Lightning starts the second with this environment)
    folder = args.dir or os.environ.get("NUMGUARD_EXAMPLE_DIR") or tempfile.mkdtemp(prefix="numguard-fsdp2-")
    os.environ["NUMGUARD_EXAMPLE_DIR"] = folder
    torch.set_num_threads(1)  # two processes on a laptop's cores
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    guard = NumGuardCallback(action="rollback", snapshot_every_n_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=120)),
        max_steps=8 if args.fast else 40,
        callbacks=[guard],
        default_root_dir=folder,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(ShardedMLP())
    if trainer.is_global_zero:
        for e in guard.events:
            print(f"step {e['step']} rank {e['rank']}: {e['kind']} in {e['where']} -> {e['action']}")
        print(f"counters: {guard.counters}; finished at step {trainer.global_step}")
        print(f"files in: {folder}")
    if torch.distributed.is_initialized():  # gloo's threads can outlive the interpreter's finalisation otherwise
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
