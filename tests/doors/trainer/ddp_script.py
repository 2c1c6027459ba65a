"""Run by test_ddp.py in a subprocess: real DDP (gloo, 2 CPU processes), a fault on one rank only.

Usage: python ddp_script.py OUT_DIR SITE FAULT_RANK ACTION [PRECISIONS]
   or: python ddp_script.py OUT_DIR --pack NAME=SITE:FAULT_RANK:ACTION[:PRECISIONS] ...  (every fit in one launch,
       in sequence, each under OUT_DIR/NAME: one process group for them all; a halting one goes last)
PRECISIONS: comma-separated (``16-mixed`` runs under a CPU GradScaler), and then SITE may be comma-separated
too: one fit per site and precision, in sequence in the same processes, each under OUT_DIR/SITE/PRECISION.
SITE ``accumulate``: ``accumulate_grad_batches=2`` and NaN inputs in batch 3 (a window's second micro-batch);
SITE ``manual``: a two-optimizer GAN (manual optimization) whose discriminator loss is NaN at batch 2;
SITE ``compile``: a ``torch.compile``d head whose ``log1p`` goes NaN at batch 3.
SITE ``spike``: an outlier batch (finite) on FAULT_RANK at step 20, ``spike_action="skip"``, in both sync modes; then
the same seen by a check of one's own (``extra_checks``, the loss above a threshold) instead, in both sync modes.
Each rank writes OUT_DIR/rank{r}.json with its events, counters and a digest of its weights.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins import MixedPrecision
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_numguard import NonFiniteError, NumGuardCallback
from tests.doors.trainer.test_setups_accumulation import TwoOptimizerGAN
from tests.doors.trainer.test_setups_matrix import CompiledLogHeadModel
from tests.helpers import FaultData, FaultModel, quiet_trainer

INPUTS = ("input", "accumulate")  # sites whose fault is a NaN batch
MODES = (*INPUTS, "manual", "compile")  # sites not injected by FaultModel


class Report(pl.Callback):
    def __init__(self, out: Path, guard: NumGuardCallback) -> None:
        self.out, self.guard = out, guard

    def on_train_end(self, trainer, pl_module):
        self.write(trainer, pl_module, None)

    def on_exception(self, trainer, pl_module, exception):  # a halt raises on every rank together: both write
        self.write(trainer, pl_module, f"{type(exception).__name__}: {exception}")

    def write(self, trainer, pl_module, raised):
        # parameters only: BatchNorm buffers legitimately differ per rank (each sees its own data)
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        gathered = trainer.strategy.all_gather(flat)
        (self.out / f"rank{trainer.global_rank}.json").write_text(
            json.dumps(
                {
                    "events": self.guard.events,
                    "counters": self.guard.counters,
                    "finite": bool(torch.isfinite(flat).all()),
                    "same_as_rank0": bool(torch.equal(gathered[0], gathered[trainer.global_rank])),
                    "global_step": trainer.global_step,
                    "raised": raised,
                }
            )
        )


def precision_args(precision: str | None) -> dict[str, Any]:
    if precision == "16-mixed":
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]}
    return {"precision": precision} if precision else {}


def main(argv: list[str] | None = None) -> None:
    """The command line without the program (``sys.argv[1:]``, or what ``pack_script.py`` hands over)."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0])
    if args[1] != "--pack":
        return run(root, args[1], int(args[2]), args[3], args[4] if len(args) > 4 else None)
    for spec in args[2:]:  # NAME=SITE:FAULT_RANK:ACTION[:PRECISIONS], each into OUT_DIR/NAME, in sequence
        name, _, fields = spec.partition("=")
        site, fault_rank, action, *precisions = fields.split(":")
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        run(out, site, int(fault_rank), action, precisions[0] if precisions else None)


def run(root: Path, site: str, fault_rank: int, action: str, precisions: str | None) -> None:
    if site in ("sharded", "sharded_async"):
        return sharded_main(root, fault_rank, action, asynchronous=site == "sharded_async")
    if site == "deferred_sharded":
        return deferred_sharded_main(root, fault_rank, action)
    if site == "spike":
        return spike_main(root, fault_rank, action)
    warnings.simplefilter("ignore")
    if precisions is None:
        fit(root, site, fault_rank, action, None)
        return
    for one_site in site.split(","):
        for precision in precisions.split(","):
            out = root / one_site / precision
            out.mkdir(parents=True, exist_ok=True)
            fit(out, one_site, fault_rank, action, precision)


def fit(out: Path, site: str, fault_rank: int, action: str, precision: str | None) -> None:
    pl.seed_everything(0, verbose=False)
    guard = NumGuardCallback(action=action, dirpath=str(out / "ng"))
    model: pl.LightningModule = FaultModel(site=None if site in MODES else site, step=2, rank=fault_rank)
    trainer = ddp_trainer(
        {"manual": 10, "accumulate": 3}.get(site, 5),
        [guard, Report(out, guard)],
        accumulate_grad_batches=2 if site == "accumulate" else 1,
        # the GAN's two backward passes per step leave the generator unused by the second
        strategy="ddp_find_unused_parameters_true" if site == "manual" else "ddp",
        enable_checkpointing=False,
        **precision_args(precision),
    )
    rank = trainer.global_rank
    # each rank trains on its own 40 samples; batch 2 of the faulty rank holds NaN
    data = FaultData(n=80, site="input")
    bad = 3 if site == "accumulate" else 2
    data.bad = (
        set(range(rank * 40 + 8 * bad, rank * 40 + 8 * bad + 8)) if site in INPUTS and rank == fault_rank else set()
    )
    if site == "manual":
        model = TwoOptimizerGAN(bad_batch=2 if rank == fault_rank else None)
    if site == "compile":
        model = CompiledLogHeadModel(rank=fault_rank)
    shard = torch.utils.data.Subset(data, list(range(rank * 40, rank * 40 + 40)))
    trainer.fit(model, DataLoader(shard, batch_size=8, shuffle=False))


def sharded_main(out: Path, fault_rank: int, action: str, asynchronous: bool = False) -> None:
    """SITE ``sharded``: two fits in one launch, ``snapshot_sharding="auto"`` then ``"off"``, the same seed.

    Snapshots every 2 steps (the one of step 2 holds BatchNorm buffers that differ per rank); AdamW's
    ``exp_avg_sq`` goes NaN at step 3 on ``fault_rank``; a ModelCheckpoint saving every step catches
    the NaN weights (the checkpoint swap gathers the sharded snapshot), the next step rolls back. Each rank saves OUT_DIR/sharded_{mode}_rank{r}.pt: its final weights, buffers and AdamW
    state, the snapshot's bytes, the events and the saved checkpoints' state dicts. ``asynchronous``: the
    ``"auto"`` fit takes its snapshots with ``snapshot_async=True`` (the ``"off"`` one stays synchronous).
    """
    from pytorch_lightning.callbacks import ModelCheckpoint

    for mode in ("auto", "off"):
        pl.seed_everything(0, verbose=False)
        guard = NumGuardCallback(
            action=action,
            dirpath=str(out / f"ng_{mode}"),
            snapshot_every_n_steps=2,
            snapshot={"sharding": mode, "asynchronous": asynchronous and mode == "auto"},
        )
        saver = ModelCheckpoint(dirpath=out / f"ckpt_{mode}", every_n_train_steps=1, save_top_k=-1)
        trainer = ddp_trainer(5, [guard, saver])
        rank = trainer.global_rank
        model = FaultModel(site="opt_state", step=3, rank=fault_rank)
        data = torch.utils.data.Subset(FaultData(n=80, site="input"), list(range(rank * 40, rank * 40 + 40)))
        trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False))
        extra = {"async": guard.snapshots.spare is not None}  # a candidate was promoted into the second buffer
        save_sharded_result(out, f"sharded_{mode}", mode, rank, trainer, model, guard, extra)


def ddp_trainer(max_steps: int, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    """A 2-process gloo DDP Trainer on the CPU, quiet, each rank feeding its own data (``strategy="ddp"`` unless
    ``kwargs`` names another)."""
    settings: dict[str, Any] = dict(devices=2, strategy="ddp", max_steps=max_steps, use_distributed_sampler=False)
    # checkpointing on: some fits bring their own ModelCheckpoint
    return quiet_trainer(callbacks, **{**settings, "enable_checkpointing": True, **kwargs})


def save_sharded_result(
    out: Path, name: str, mode: str, rank: int, trainer: Any, model: Any, guard: Any, extra: dict[str, Any]
) -> None:
    """What a sharded-snapshot launch compares between its ``"auto"`` and ``"off"`` fits, saved per rank."""
    snapshot = guard.snapshots.snapshot
    assert snapshot is not None
    ckpts = sorted((out / f"ckpt_{mode}").glob("*.ckpt")) if rank == 0 else []
    result = {
        "state": model.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "snapshot_nbytes": snapshot.nbytes,
        "sharded_nbytes": snapshot.sharded.nbytes if snapshot.sharded is not None else 0,
        "events": guard.events,
        "counters": guard.counters,
        "checkpoints": {f.name: torch.load(f, weights_only=False)["state_dict"] for f in ckpts},
        **extra,
    }
    torch.save(result, out / f"{name}_rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"modes_done": mode}))


class StepWindow(pl.Callback):
    """A ``SyncCounter`` step window around each training batch; after it, what the deferred ring holds."""

    def __init__(self, counter: Any, guard: NumGuardCallback) -> None:
        self.counter, self.guard = counter, guard
        self.ring: list[list[tuple[int, bool, int]]] = []  # per step: (step, sharded, nbytes) of each snapshot
        self.storage: dict[int, list[int]] = {}  # per snapshot step: the data pointers of its sharded slices

    def on_train_batch_start(self, *args: Any) -> None:
        self.counter.step_started()

    def on_train_batch_end(self, *args: Any) -> None:
        self.counter.step_ended()
        late = self.guard.snapshots.late  # the deferred read's candidates and its last verified snapshot
        held = [*late.candidates, *([late.last] if late.last else [])]
        self.ring.append([(step, s.sharded is not None, s.nbytes) for step, s in held])
        for step, s in held:
            if s.sharded is not None:
                self.storage.setdefault(step, sorted(t.data_ptr() for t in s.sharded.local.values()))


def deferred_sharded_main(out: Path, fault_rank: int, action: str) -> None:
    """SITE ``deferred_sharded``: ``sync_mode="deferred"``, ``snapshot_sharding="auto"`` then ``"off"``, the same seed.

    A fused AdamW (the device-side skip needs it) whose ``exp_avg_sq`` goes NaN at step 3 on ``fault_rank``:
    step 3's update leaves NaN weights on that rank, a ModelCheckpoint saving every step swaps them for the
    verified snapshot's (a gather), step 4's flags see them and the late read at step 5 rolls every rank back
    (a gather). Snapshots every 2 steps, so the ring holds a candidate while the verified one is kept. Each rank
    saves OUT_DIR/deferred_{mode}_rank{r}.pt: its final weights, buffers and AdamW state, the bytes of the
    verified snapshot, what the ring held after each step (and where each snapshot's slices live), the events, the
    counters, the saved checkpoints' state dicts and the guard's host reads per step (``SyncCounter``).

    Then the same fault under ``action="halt"`` (OUT_DIR/deferred_halt_{mode}_rank{r}.pt), and a NaN weight on
    ``fault_rank`` at the last step, which only the end-of-fit read of the pending flags sees: it rolls every rank
    back there (OUT_DIR/deferred_end_{mode}_rank{r}.pt).
    """
    from pytorch_lightning.callbacks import ModelCheckpoint

    from instruments.syncs import SyncCounter

    for mode in ("auto", "off"):
        counter = SyncCounter(package="lightning_numguard")
        saver = ModelCheckpoint(dirpath=out / f"ckpt_{mode}", every_n_train_steps=1, save_top_k=-1)
        windows: list[StepWindow] = []

        def callbacks(
            guard: NumGuardCallback, counter: Any = counter, saver: Any = saver, windows: list[StepWindow] = windows
        ) -> list[Any]:
            windows.append(StepWindow(counter, guard))
            return [windows[-1], guard, saver]

        guard, trainer, model, data = _deferred_run(
            out / f"ng_{mode}", mode, action, fault_rank, "opt_state", 3, callbacks
        )
        with counter:
            trainer.fit(model, data)
        window = windows[-1]
        extra = {"ring": window.ring, "storage": window.storage, "reads_per_step": counter.step_caused}
        save_sharded_result(out, f"deferred_{mode}", mode, trainer.global_rank, trainer, model, guard, extra)
    for mode in ("auto", "off"):  # the same fault under action="halt": the late halt gathers the snapshot once
        guard, trainer, model, data = _deferred_run(out / f"ng_halt_{mode}", mode, "halt", fault_rank, "opt_state", 3)
        raised = None
        try:
            trainer.fit(model, data)
        except NonFiniteError as err:  # every rank raises together
            raised = str(err)
        rank = trainer.global_rank
        last = out / f"ng_halt_{mode}" / "last_finite.ckpt"
        halted = {
            **_ending(trainer, model, guard),
            "raised": raised,
            "sharded": guard.snapshots.snapshot is not None and guard.snapshots.snapshot.sharded is not None,
            "last_finite": torch.load(last, weights_only=False)["state_dict"] if rank == 0 else None,
        }
        torch.save(halted, out / f"deferred_halt_{mode}_rank{rank}.pt")
    for mode in ("auto", "off"):  # a NaN weight at the last step: only the end-of-fit read sees it, and repairs it
        guard, trainer, model, data = _deferred_run(out / f"ng_end_{mode}", mode, "rollback", fault_rank, "param", 9)
        trainer.fit(model, data)
        ended = {**_ending(trainer, model, guard), "fired": model.fired}
        torch.save(ended, out / f"deferred_end_{mode}_rank{trainer.global_rank}.pt")


def _deferred_run(
    dirpath: Path,
    mode: str,
    action: str,
    fault_rank: int,
    site: str,
    step: int,
    callbacks: Any = None,
) -> tuple[NumGuardCallback, pl.Trainer, Any, DataLoader]:
    """A 10-step ``sync_mode="deferred"`` DDP run, not yet fitted: a fused-AdamW ``FaultModel`` with a fault at
    ``site``/``step`` on ``fault_rank``, snapshots every 2 steps, ``snapshot_sharding=mode``; each rank its own data.

    ``callbacks(guard)`` gives the trainer's callbacks (default: the guard alone, no checkpointing).
    """
    from tests.doors.trainer.test_zerosync import FusedModel

    pl.seed_everything(0, verbose=False)
    guard = NumGuardCallback(
        action=action,
        dirpath=str(dirpath),
        snapshot_every_n_steps=2,
        sync_mode="deferred",
        snapshot={"sharding": mode},
        spikes={"window": 0},
    )
    if callbacks is None:
        trainer = ddp_trainer(10, [guard], enable_checkpointing=False)
    else:
        trainer = ddp_trainer(10, callbacks(guard))
    rank = trainer.global_rank
    model = FusedModel(site=site, step=step, rank=fault_rank)
    data = torch.utils.data.Subset(FaultData(n=80, site="input"), list(range(rank * 40, rank * 40 + 40)))
    return guard, trainer, model, DataLoader(data, batch_size=8, shuffle=False)


def spike_main(out: Path, fault_rank: int, action: str) -> None:
    """An outlier batch on ``fault_rank`` only at step 20 (its loss ~1000x), ``spike_action="skip"``, 24 steps, in
    each sync mode. Each rank saves OUT_DIR/spike_{mode}_rank{r}.pt: events, counters, its spike window and a
    gather of every rank's parameters."""
    from tests.doors.trainer.test_spike import Regression, regression_data

    class RankOutlier(Regression):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.global_step in self.outliers and self.global_rank == fault_rank:
                y = y * 10 + 30
            return torch.nn.functional.mse_loss(self.lin(x), y)

    from tests.toy.loss_above import LossAbove

    for mode in ("every_step", "deferred", "extra_every_step", "extra_deferred"):
        pl.seed_everything(0, verbose=False)
        # extra_*: no spike action; the check of one's own (loss above 100) sees the outlier instead
        spikes: dict[str, Any] = {"spike_action": "skip", "spikes": {"window": 16, "warmup": 8}}
        guard = NumGuardCallback(
            action=action,
            dirpath=str(out / f"ng_{mode}"),
            sync_mode=mode.removeprefix("extra_"),  # type: ignore[arg-type]
            emit_warnings=False,
            **({"extra_checks": [LossAbove(100.0)]} if mode.startswith("extra_") else spikes),
        )
        trainer = ddp_trainer(24, [guard])
        rank = trainer.global_rank
        data = torch.utils.data.Subset(regression_data(192, seed=0), list(range(rank * 96, rank * 96 + 96)))
        model = RankOutlier(outliers=(20,))
        trainer.fit(model, DataLoader(data, batch_size=4, shuffle=False))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        result = {
            "events": guard.events,
            "counters": dict(guard.counters),
            "window": guard.state_dict()["spike"],
            "params": trainer.strategy.all_gather(flat).cpu(),
        }
        torch.save(result, out / f"spike_{mode}_rank{rank}.pt")
        (out / f"rank{rank}.json").write_text(json.dumps({"events": guard.events, "counters": guard.counters}))


def _ending(trainer: pl.Trainer, model: Any, guard: NumGuardCallback) -> dict[str, Any]:
    """What a deferred run's launch compares: final weights and AdamW state, step, events and counters."""
    return {
        "state": model.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "global_step": trainer.global_step,
        "events": guard.events,
        "counters": guard.counters,
    }


if __name__ == "__main__":
    main()
    # Without this, gloo's worker threads can outlive the interpreter's finalisation and abort the process after a
    # successful run ("terminate called without an active exception", exit -6; pytorch/pytorch#190489): the
    # intermittent failure of these launches. Every rank runs this script (Lightning relaunches it for rank 1).
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
