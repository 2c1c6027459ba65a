"""The FSDP2 row, launched: the user-style ``TinyGPT`` sharded with ``fully_shard`` over 2 gloo CPU processes
(``ModelParallelStrategy``); at ``BAD_STEP`` rank 1 writes a NaN into its local shard of one weight.

Usage: ``python -m instruments.diagnosis.real.fsdp2_script OUT_DIR``; each rank writes ``OUT_DIR/rank{r}.json`` (the
guard's events, or the traceback of a fit that raised).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from instruments.diagnosis.real.harness import BAD_STEP, Leaf, Row
from instruments.diagnosis.real.user_code import TinyGPT, gpt_data

SHARD_RANK = 1
SHARDED_WEIGHT = "blocks.0.mlp.fc1.weight"


class ShardedGPT(TinyGPT):
    """``TinyGPT`` with each block and the root ``fully_shard``-ed over the data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh
        assert mesh is not None
        for block in self.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == BAD_STEP and self.global_rank == SHARD_RANK and not getattr(self, "_done", False):
            self._done = True
            with torch.no_grad():
                self.get_parameter(SHARDED_WEIGHT).to_local()[0] = float("nan")  # FAULT: nan-shard


ROW = Row("fsdp2_shard_nan", "user code: tiny GPT, FSDP2 (2 gloo ranks)", "a NaN in rank 1's local shard of a weight",
          lambda: (ShardedGPT(), gpt_data()), "nonfinite_param", None, Leaf(SHARDED_WEIGHT, "nan-shard"), __file__,
          note="ModelParallelStrategy(2, 1) + fully_shard, gloo; launched in 2 processes", rank=SHARD_RANK)  # fmt: skip


def main() -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy

    from instruments.faults import quiet_trainer
    from lightning_numguard import NumGuardCallback

    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    guard = NumGuardCallback(action="skip", dirpath=str(out / "ng"))
    trainer = quiet_trainer(
        [guard], devices=2, strategy=ModelParallelStrategy(2, 1, timeout=timedelta(seconds=90)), max_steps=ROW.steps
    )
    model, data = ROW.build()
    result: dict[str, Any] = {}
    try:
        trainer.fit(model, data)
    except Exception:
        result["error"] = traceback.format_exc()
    result.update({"rank": trainer.global_rank, "events": guard.events})
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
