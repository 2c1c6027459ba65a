"""Run by test_sharded_lib.py in a subprocess: ModelParallelStrategy (FSDP2, tensor parallel, 2-D) on CPU/gloo.

Usage: python sharded_lib_script.py OUT_DIR LAYOUT/SCENARIO[,LAYOUT/SCENARIO...]
LAYOUT: ``fsdp`` (2 ranks, ``fully_shard``), ``tp`` (2 ranks, ``parallelize_module``), ``2d`` (4 ranks, both); the
layouts of one launch share its world size. The runs go one after another in the same processes, each under
OUT_DIR/LAYOUT/SCENARIO. SCENARIO:

* ``plain``: no guard; ``clean``: the guard with its defaults (rollback), no fault;
* ``param``: a NaN written into rank 1's local shard of ``body.0.weight`` at step 2 (rollback);
* ``opt_state``: rank 1's local shard of AdamW's ``exp_avg_sq`` of ``body.2.weight`` NaN at step 2 (rollback);
* ``skip``: batch 2 of data-parallel rank 1 is NaN (action ``skip``); ``omit``: no guard, batch 2 left out on
  every rank (``skip`` and ``omit`` have no LR scheduler);
* ``retry``: batch 2 of data-parallel rank 1 is NaN, rolled back with ``retry_transient``, ``lr_backoff=0.5`` and
  one batch skipped after the rollback; ``accumulate``: ``accumulate_grad_batches=2``, batch 3 of data-parallel
  rank 1 NaN (rollback); ``async``: as ``param``, with ``snapshot_async=True`` (a worker thread on the CPU);
* ``bf16``: as ``param``, under ``precision="bf16-mixed"``;
* ``warn``: as ``param`` under ``action="warn"`` (recorded, nothing restored);
* ``end``: rank 1's shard of ``body.2.weight`` NaN after the last step (rolled back by the end-of-fit check);
* ``halt``: the loss of rank 1 NaN at step 2 (action ``halt``), then ``resume``: a new fit from its
  ``last_finite.ckpt`` to ``max_steps`` 5;
* ``fused``: no guard, a fused AdamW; ``deferred_clean``, ``deferred`` (as ``param``), ``deferred_halt`` (as
  ``halt``): ``sync_mode="deferred"`` with a fused AdamW;
* a name ending in ``_file`` (``halt_file``, ``resume_file``, ``opt_state_file``): that scenario with checkpoints
  written as one file (``save_distributed_checkpoint=False``).

Each rank writes OUT_DIR/SCENARIO/rank{r}.json (events, counters, global step, whether the gathered weights are
finite and equal on every rank, the snapshot's bytes) and rank 0 OUT_DIR/SCENARIO/weights.pt (the gathered weights).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from instruments.syncs import SyncCounter
from lightning_numguard import NonFiniteError, NumGuardCallback
from tests.helpers import quiet_trainer, spike_window

STEPS = 5
FAULTS = {
    "warn": "param",
    "deferred": "param",
    "deferred_halt": "loss",
    "end": "end",
    "param": "param",
    "twice": "param",
    "opt_state": "opt_state",
    "halt": "loss",
    "async": "param",
    "bf16": "param",
}


class Data(Dataset):
    """80 samples; those of ``bad`` hold NaN."""

    def __init__(self, bad: set[int] | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(80, 8, generator=g), torch.randn(80, 1, generator=g)
        self.bad = bad or set()

    def __len__(self) -> int:
        return 80

    def __getitem__(self, j: int) -> dict[str, Any]:
        x = self.x[j].clone()
        if j in self.bad:
            x[0] = float("nan")
        return {"x": x, "y": self.y[j]}


class Model(pl.LightningModule):
    def __init__(
        self,
        layout: str,
        site: str | None = None,
        step: int | tuple[int, ...] = 2,
        rank: int = 1,
        scheduler: bool = True,
    ) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        # FSDP2: buffers, whole on every rank, restored by a skip as they were (under tensor parallelism the
        # replicated BatchNorm parameters drift apart across ranks even without the guard: left out there)
        self.norm = nn.BatchNorm1d(16) if layout == "fsdp" else nn.Identity()
        self.head = nn.Linear(16, 1)
        self.layout, self.site, self.fault_step, self.fault_rank = layout, site, step, rank
        self.scheduler = scheduler

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.layout in ("tp", "2d"):
            parallelize_module(
                self.body,
                self.device_mesh["tensor_parallel"],
                # body.0's output stays a DTensor (sharded on its last dim): the guard watches its local shard
                {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()},
            )
        if self.layout in ("fsdp", "2d"):
            mesh = self.device_mesh["data_parallel"]
            for module in (self.body[0], self.body[2], self.head):
                fully_shard(module, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))

    def _armed(self) -> bool:
        steps = self.fault_step if isinstance(self.fault_step, tuple) else (self.fault_step,)
        return self.site is not None and self.global_step in steps and self.global_rank == self.fault_rank

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self._armed():
            return
        from lightning_numguard.dtensor import local

        with torch.no_grad():
            if self.site == "param":
                local(self.body[0].weight).view(-1)[0] = float("nan")
            elif self.site == "opt_state":
                state = self.trainer.optimizers[0].state[self.body[2].weight]
                local(state["exp_avg_sq"]).view(-1)[0] = float("nan")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # after the guard's own hook: the last step's update is only seen by the end-of-fit check
        if self.site == "end" and self.global_step == STEPS and self.global_rank == self.fault_rank:
            from lightning_numguard.dtensor import local

            with torch.no_grad():
                local(self.body[2].weight).view(-1)[0] = float("nan")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self(batch["x"]), batch["y"])
        if self.site == "loss" and self._armed():
            loss = loss + float("nan")
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, fused=getattr(self, "fused", False))
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (collective: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


class StepWindow(pl.Callback):
    """A ``SyncCounter`` step window around each training batch."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, *args: Any) -> None:
        self.counter.step_started()

    def on_train_batch_end(self, *args: Any) -> None:
        self.counter.step_ended()


def all_finite(folder: Path, tmp: Path) -> bool:
    """Whether every floating tensor of a checkpoint (a distributed-checkpoint folder, or a file) is finite."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_numguard.tree import tensors

    if folder.is_dir():
        dcp_to_torch_save(folder, tmp)
    state = torch.load(tmp if folder.is_dir() else folder, weights_only=False)
    if not folder.is_dir():  # the model's and optimizers' states (callback states hold inf on purpose: kth_value)
        state = {k: state[k] for k in ("state_dict", "optimizer_states") if k in state}
    found = [t for t in tensors(state) if t.is_floating_point()]
    return bool(found) and all(bool(torch.isfinite(t).all()) for t in found)


def strategy(layout: str, folder: bool = True) -> ModelParallelStrategy:
    dp, tp = {"fsdp": (2, 1), "tp": (1, 2), "2d": (2, 2)}[layout]
    return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, save_distributed_checkpoint=folder)


def run(out: Path, layout: str, name: str) -> None:
    pl.seed_everything(0, verbose=False)
    out.mkdir(parents=True, exist_ok=True)
    scenario = name.removesuffix("_file")  # ..._file: checkpoints as one file (save_distributed_checkpoint=False)
    folder = scenario == name
    action = {"skip": "skip", "halt": "halt", "deferred_halt": "halt", "warn": "warn"}.get(scenario, "rollback")
    guard = None
    if scenario not in ("plain", "omit", "fused"):
        extra: dict[str, Any] = {}
        if scenario == "retry":
            extra = {"recovery": {"retry_transient": True}, "lr_backoff": 0.5, "skip_batches_after_rollback": 1}
        if scenario == "async":
            extra = {"snapshot": {"asynchronous": True}}
        if scenario.startswith("deferred"):
            extra = {"sync_mode": "deferred"}
        guard = NumGuardCallback(
            action=action,
            dirpath=str(out.parent / name.replace("resume", "halt") / "ng" if scenario == "resume" else out / "ng"),
            **extra,
        )
    world = 4 if layout == "2d" else 2
    savers: list[Any] = []
    if scenario == "opt_state":  # saves the poisoned state of step 2's end, seen by the guard at step 3
        savers.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=-1))
    trainer = quiet_trainer(
        ([guard] if guard is not None else []) + savers,
        devices=world,
        strategy=strategy(layout, folder),
        max_steps=STEPS,
        max_epochs=1,
        enable_checkpointing=scenario == "opt_state",
        default_root_dir=str(out),
        use_distributed_sampler=False,
        accumulate_grad_batches=2 if scenario == "accumulate" else 1,
        precision="bf16-mixed" if scenario == "bf16" else "32-true",
    )
    steps = (1, 3) if scenario == "twice" else 2
    model = Model(layout, site=FAULTS.get(scenario), step=steps, scheduler=scenario not in ("skip", "omit"))
    model.fused = scenario.startswith("deferred") or scenario == "fused"  # the deferred mode skips through found_inf
    tp = 2 if layout in ("tp", "2d") else 1
    dp_rank = trainer.global_rank // tp  # the mesh is (data_parallel, tensor_parallel), row-major
    # each data-parallel rank trains on its own 40 samples, in batches of 8; batch 2 of dp rank 1 is the bad one
    bad = set(range(40 + 16, 40 + 24)) if layout != "tp" else set(range(16, 24))
    if scenario == "accumulate":  # batch 3: the second micro-batch of the second window
        bad = {i + 8 for i in bad}
    data = Data(bad=bad if scenario in ("skip", "retry", "accumulate") else None)
    own = [
        i for i in range(dp_rank * 40, dp_rank * 40 + 40) if scenario != "omit" or i - dp_rank * 40 not in range(16, 24)
    ]
    data = torch.utils.data.Subset(data, own)
    ckpt = (
        str(out.parent / name.replace("resume", "halt") / "ng" / "last_finite.ckpt") if scenario == "resume" else None
    )
    counter = SyncCounter(package="lightning_numguard")
    if scenario in ("clean", "deferred_clean"):  # the guard's host reads in each training batch
        trainer.callbacks.append(StepWindow(counter))
    raised = None
    try:
        with counter:
            trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False), ckpt_path=ckpt)
    except NonFiniteError as err:  # a halt: every rank raises together, and goes on to the collectives below
        raised = str(err)
    weights = gathered(model)
    flat = torch.cat([w.reshape(-1) for w in weights.values()])
    every = trainer.strategy.all_gather(flat)
    rank = trainer.global_rank
    result = {
        "events": guard.events if guard else [],
        "counters": guard.counters if guard else {},
        "global_step": trainer.global_step,
        "raised": raised,
        "finite": bool(torch.isfinite(flat).all()),
        "same_as_rank0": bool(torch.equal(every[0], every[rank])),
        "snapshot_nbytes": guard.snapshots.snapshot.nbytes if guard and guard.snapshots.snapshot else None,
        "local_param_nbytes": sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters()
        ),
        "full_param_nbytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "buffer_nbytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        # the spike statistics' window (2 x spike_window float32) is snapshotted with the rest
        "spike_nbytes": window.values.nbytes if guard and (window := spike_window(guard)) is not None else 0,
        "reads_per_step": counter.step_caused,
    }
    trainer.strategy.barrier()
    if rank == 0:
        folders = sorted((out / "ckpt").glob("*.ckpt")) + sorted((out / "ng").glob("last_finite.ckpt"))
        result["checkpoints"] = {f.name: all_finite(f, out / "converted.pt") for f in folders}
        result["ng_files"] = sorted(p.name for p in (out / "ng").glob("*")) if (out / "ng").exists() else []
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        torch.save(weights, out / "weights.pt")
    if os.environ.get("NG_DEBUG_WEIGHTS"):
        torch.save(weights, out / f"weights{rank}.pt")


def main(argv: list[str] | None = None) -> None:
    """The command line without the program (``sys.argv[1:]``, or what ``pack_script.py`` hands over)."""
    args = sys.argv[1:] if argv is None else argv
    warnings.simplefilter("ignore")
    out = Path(args[0])
    for spec in args[1].split(","):  # LAYOUT/SCENARIO, in sequence, in the one process group
        layout, scenario = spec.split("/")
        run(out / layout / scenario, layout, scenario)


if __name__ == "__main__":
    main()
    # gloo's worker threads can outlive the interpreter's finalisation and abort a successful run (see ddp_script.py)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
