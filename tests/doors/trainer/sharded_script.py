"""Run by test_sharded.py in a subprocess: real ``ModelParallelStrategy`` runs (gloo, CPU processes).

Usage: python sharded_script.py OUT_DIR LAYOUT/SCENARIO[,LAYOUT/SCENARIO...]

LAYOUT: ``fsdp2`` (2 ranks, ``fully_shard`` on each linear and the root over the data-parallel mesh), ``tp`` (2 ranks,
``fc1`` column-wise and ``fc2`` row-wise over the tensor-parallel mesh) or ``2d`` (4 ranks, 2 data-parallel x 2
tensor-parallel: tensor parallel first, then ``fully_shard``); the layouts of one launch have the same world size.
SCENARIO: a name from ``SCENARIOS`` below. One fit each, in sequence in the same processes (a launch costs seconds
of imports per process; a fit of this model about one), each rank writing OUT_DIR/LAYOUT/SCENARIO/rank{r}.json:
events, counters, ``global_step``, whether the
weights are finite, and sha256 digests of the full weights and of the full AdamW state (gathered with
``DTensor.full_tensor()``: the harness only; the guard never gathers). A fit that raises writes its traceback
instead (every rank that raised), and the launch goes on with the next scenario.

Faults (on global rank 1, at global step 2, written in the LightningModule's ``on_train_batch_start``):
``shard``: NaN into row 0 of rank 1's local shard of ``fc1.weight`` (``p.to_local()[0] = nan`` under ``no_grad``);
``output``: the activation between the linears multiplies its (local) output by NaN on rank 1;
``input``: the batch 2 of data-parallel rank 1 holds NaN (its step 2).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_numguard import NumGuardCallback
from tests.helpers import quiet_trainer

#: layout: (data_parallel_size, tensor_parallel_size)
LAYOUTS = {"fsdp2": (2, 1), "tp": (1, 2), "2d": (2, 2)}
STEPS = 6  # optimizer steps of a fit
FAULT_STEP = BAD_BATCH = 2  # the step of every fault, and the batch an ``input`` fault poisons (its step 2)
FAULT_RANK = 1
EVERY_STEP = {"snapshot_every_n_steps": 1}  # a rollback at step 2 restores the state after step 1
#: scenario: guard settings (None: no guard), fault, max_steps, the batches every data-parallel rank leaves out.
#: A skip of step 2, or a rollback of it to the snapshot taken at its own read (an output fault: the state at the
#: start of step 2 was verified finite there), ends where ``omit`` ends: batch 2 left out everywhere. A shard fault
#: poisons the state at the start of step 2, so its read takes no snapshot: the rollback restores the one of step 1
#: (the state after batch 0) and ends where ``omit12`` ends: batches 1 and 2 left out everywhere.
SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {"guard": None},
    "clean": {"guard": {}},  # the defaults
    "shard": {"guard": EVERY_STEP, "fault": "shard"},
    "warn": {"guard": {"action": "warn"}, "fault": "shard"},
    "output": {"guard": EVERY_STEP, "fault": "output"},
    "skip": {"guard": {"action": "skip"}, "fault": "input"},
    "omit": {"guard": None, "omit": (BAD_BATCH,), "steps": STEPS - 1},
    "omit12": {"guard": None, "omit": (1, 2), "steps": STEPS - 2},
    "halt": {"guard": {"action": "halt", **EVERY_STEP}, "fault": "shard"},
    "resume": {"guard": {}, "resume": "halt"},  # fits from OUT_DIR/halt/ng/last_finite.ckpt, no fault
}


class Act(nn.Module):
    """ReLU; multiplies its output by NaN while ``armed``."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(x)
        return out * float("nan") if self.armed else out


class ShardedMLP(pl.LightningModule):
    """``fc1`` (8 -> 32), ``act``, ``fc2`` (32 -> 8); AdamW; parallelised in ``configure_model`` by ``layout``.

    Its own ``train_dataloader``: data-parallel rank d trains on samples [32 d, 32 d + 32) of one seeded set, in
    order, 4 a batch; ``omit`` leaves those batches out on every data-parallel rank; the ``input`` fault makes
    batch ``BAD_BATCH`` of data-parallel rank 1 NaN.
    """

    def __init__(self, layout: str, fault: str | None = None, omit: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.layout, self.fault, self.omit = layout, fault, omit
        self.fc1 = nn.Linear(8, 32)
        self.act = Act()
        self.fc2 = nn.Linear(32, 8)
        self.fired = 0

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        assert mesh is not None
        if self.layout in ("tp", "2d"):
            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            parallelize_module(self, mesh["tensor_parallel"], plan)  # type: ignore[arg-type]
        if self.layout in ("fsdp2", "2d"):
            for layer in (self.fc1, self.fc2):
                fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(self, mesh=mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def _armed(self) -> bool:
        return self.fault is not None and self.global_step == FAULT_STEP and self.global_rank == FAULT_RANK

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.act.armed = self.fault == "output" and self._armed()
        if self.fault == "shard" and self._armed():
            with torch.no_grad():
                self.fc1.weight.to_local()[0] = float("nan")  # type: ignore[operator]
        self.fired += int(self.fault in ("shard", "output") and self._armed())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).sum(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        mesh = self.device_mesh
        assert mesh is not None
        dp = mesh["data_parallel"].get_local_rank()
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, generator=g)
        x, y = x[32 * dp : 32 * dp + 32], y[32 * dp : 32 * dp + 32]
        if self.fault == "input" and dp == 1:
            x[4 * BAD_BATCH : 4 * BAD_BATCH + 4, 0] = float("nan")
        keep = [i for i in range(32) if i // 4 not in self.omit]
        return DataLoader(TensorDataset(x[keep], y[keep]), batch_size=4, shuffle=False)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a ``DTensor`` gathered (a collective: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def digests(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """sha256 of the full weights and of the full AdamW state, and whether the full weights are finite."""
    weights, state = hashlib.sha256(), hashlib.sha256()
    finite = True
    for name, p in module.named_parameters():
        whole = full(p.detach())
        finite = finite and bool(torch.isfinite(whole).all())
        weights.update(name.encode() + whole.contiguous().numpy().tobytes())
        for key, value in sorted((optimizer.state.get(p, {}) if optimizer else {}).items()):
            if isinstance(value, torch.Tensor):
                state.update(f"{name}.{key}".encode() + full(value).detach().contiguous().numpy().tobytes())
    return {"digest": weights.hexdigest(), "opt_digest": state.hexdigest(), "finite": finite}


class Report(pl.Callback):
    """Records the state at train start and at train end (digests gathered on every rank)."""

    def __init__(self, guard: NumGuardCallback | None) -> None:
        self.guard = guard
        self.start: dict[str, Any] = {}
        self.end: dict[str, Any] = {}

    def _now(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return {
            "global_step": trainer.global_step,
            "counters": dict(self.guard.counters) if self.guard else None,
            **digests(pl_module, trainer.optimizers[0] if trainer.optimizers else None),
        }

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = self._now(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = self._now(trainer, pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.end = self._now(trainer, pl_module)  # a halt raises on every rank together: each reports its end


def fit(root: Path, layout: str, name: str) -> None:
    spec = SCENARIOS[name]
    root = root / layout
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    settings = spec["guard"]
    guard = None if settings is None else NumGuardCallback(dirpath=str(out / "ng"), **settings)
    report = Report(guard)
    dp, tp = LAYOUTS[layout]
    trainer = quiet_trainer(
        [c for c in (guard, report) if c is not None],
        devices=dp * tp,
        strategy=ModelParallelStrategy(dp, tp, timeout=timedelta(seconds=90)),
        max_steps=spec.get("steps", STEPS),
        use_distributed_sampler=False,
    )
    model = ShardedMLP(layout, spec.get("fault"), spec.get("omit", ()))
    ckpt = root / spec["resume"] / "ng" / "last_finite.ckpt" if "resume" in spec else None
    result: dict[str, Any] = {"scenario": name, "layout": layout}
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except Exception:
        result["error"] = traceback.format_exc()
    result.update(
        {
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "events": guard.events if guard else [],
            "counters": guard.counters if guard else None,
            "fired": model.fired,
            "start": report.start,
            **report.end,
        }
    )
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=str))


def main(argv: list[str] | None = None) -> None:
    """The command line without the program (``sys.argv[1:]``, or what ``pack_script.py`` hands over)."""
    args = sys.argv[1:] if argv is None else argv
    root, runs = Path(args[0]), [run.split("/") for run in args[1].split(",")]
    if len({math.prod(LAYOUTS[layout]) for layout, _ in runs}) != 1:
        raise SystemExit(f"the layouts of one launch must have the same world size: {args[1]}")
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    for layout, name in runs:
        fit(root, layout, name)


if __name__ == "__main__":
    main()
    # gloo's worker threads can outlive the interpreter's finalisation and abort a successful run (see ddp_script.py)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
