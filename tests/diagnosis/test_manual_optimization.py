"""Issue 10: the replay under manual optimization (two optimizers, ``automatic_optimization=False``).

The replay re-runs ``training_step``, which calls ``opt.step()`` itself: it must name the culprit
module and op, and move neither the weights, the optimizers' state nor Lightning's step counter.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_numguard import NumGuardCallback
from tests.helpers import quiet_trainer

BAD_STEP = 4  # in optimizer steps: two per batch, so the third batch


class Act(nn.Module):
    """``log`` of a shifted input: negative, hence NaN from finite inputs, when ``bad``."""

    bad = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(h.abs() + 1.0 - (10.0 if self.bad else 0.0))


class TinyGAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 4), Act())
        self.disc = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        opt_g, opt_d = self.optimizers()
        self.gen[1].bad = self.global_step == BAD_STEP
        fake = self.gen(x)
        d_loss = self.disc(x).pow(2).mean() + (self.disc(fake.detach()) - 1).pow(2).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = self.disc(fake).pow(2).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log("g_loss", g_loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.gen.parameters(), lr=1e-2), torch.optim.Adam(self.disc.parameters(), lr=1e-2)


class OptimizerStateSpy(pl.Callback):
    """Keeps the optimizers' state at the bad batch's start and at its first optimizer step (after the guard's read)."""

    def __init__(self) -> None:
        self.before: list[Any] | None = None
        self.after: list[Any] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == BAD_STEP:
            self.before = copy.deepcopy([o.state_dict() for o in trainer.optimizers])

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.before is not None and self.after is None:
            self.after = copy.deepcopy([o.state_dict() for o in trainer.optimizers])


def _fit(tmp_path: Any, callbacks: list[Any]) -> pl.Trainer:
    torch.manual_seed(0)
    x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
    trainer = quiet_trainer(callbacks, max_epochs=1, devices=1, default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGAN(), DataLoader(TensorDataset(x), batch_size=8))
    return trainer


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_replay_under_manual_optimization_names_the_module_and_moves_nothing(tmp_path) -> None:
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    spy = OptimizerStateSpy()
    guarded = _fit(tmp_path, [guard, spy])
    plain = _fit(tmp_path, [])

    assert guarded.global_step == plain.global_step == 12  # 6 batches, 2 optimizer steps each
    first = guard.events[0]
    assert (first["kind"], first["step"], first["action"]) == ("nonfinite_output", BAD_STEP, "rollback")
    assert first["where"] == ["gen.1"] and first["details"]["replay"]["forward_module"] == "gen.1"
    assert (first["op"], first["module"]) == ("log", "gen.1")
    lines, start = inspect.getsourcelines(Act.forward)
    log_line = start + next(i for i, line in enumerate(lines) if "torch.log(" in line)
    assert first["source"] == f"{__file__}:{log_line}"  # the user's line, found by the replay
    assert spy.before is not None and spy.after is not None
    assert _same(spy.before, spy.after)  # the replay ran both optimizers' steps as closures only
