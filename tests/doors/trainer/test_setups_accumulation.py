"""Gradient accumulation names, quarantines and replays the micro-batch that went bad; manual optimization."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import FaultData, FaultModel, loader, trainer


def test_accumulation_names_and_quarantines_the_third_micro_batch(tmp_path):
    """Window 1 holds batches 4..7; batch 6 (its third micro-batch) is NaN. Before: the event said batch 4."""
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), max_rollbacks=5)
    t = trainer(tmp_path, [guard], max_epochs=2, accumulate_grad_batches=4)
    with pytest.warns(NumGuardWarning, match=r"batch\['x'\]"):
        t.fit(FaultModel(), loader(FaultData(bad_batch=6, site="input")))
    first = guard.events[0]
    assert first["kind"] == "nonfinite_input" and first["batch_idx"] == 6, first
    assert {e["batch_idx"] for e in guard.events} == {6}
    assert [q["batch_idx"] for q in guard.quarantined] == [6]  # failed in both epochs: the bad one is kept
    saved = torch.load(guard.quarantined[0]["file"], weights_only=False)
    assert torch.isnan(saved["batch"]["x"]).any()
    assert saved["sample_indices"] == list(range(48, 56))


class TwoOptimizerGAN(pl.LightningModule):
    """Manual optimization with a generator and a discriminator; the discriminator's loss is NaN at ``bad_step``."""

    def __init__(self, bad_batch: int | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Linear(8, 8)
        self.disc = nn.Linear(8, 1)
        self.bad_batch = bad_batch

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        fake = self.gen(batch["x"])
        loss_g = self.disc(fake).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        loss_d = (self.disc(batch["x"]) - self.disc(fake.detach())).pow(2).mean()
        if batch_idx == self.bad_batch:
            loss_d = loss_d * float("nan")
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.log("loss_d", loss_d)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(self.disc.parameters(), lr=1e-3)


@pytest.mark.parametrize("bad_batch", [None, 2])
def test_manual_two_optimizer_gan_keeps_global_step(tmp_path, bad_batch):
    """The read, the skip and the counters with two optimizers per batch.

    ``replay=False``: the replay of a manual-optimization step (which re-enters ``training_step`` and its
    ``opt.step()``) is the diagnosis's part, tested with it.
    """
    torch.manual_seed(0)
    ref = trainer(tmp_path / "ref", [], max_epochs=1)
    ref.fit(TwoOptimizerGAN(), loader(FaultData(n=48)))
    guard = NumGuardCallback(
        dirpath=str(tmp_path / "ng"), emit_warnings=False, recovery={"replay": False}
    )  # reads the events
    t = trainer(tmp_path / "ng", [guard], max_epochs=1)
    torch.manual_seed(0)
    t.fit(TwoOptimizerGAN(bad_batch), loader(FaultData(n=48)))
    assert t.global_step == ref.global_step == 12  # two optimizer steps per batch, 6 batches
    assert guard.counters["skipped_steps"] == (0 if bad_batch is None else 1)
    assert bool(guard.events) == (bad_batch is not None)
    if bad_batch is not None:
        assert {e["batch_idx"] for e in guard.events} == {bad_batch}
        assert guard.events[0]["kind"] == "nonfinite_loss"  # the discriminator's loss, read at its optimizer


class _DrawFault(nn.Module):
    """NaN when its random draw repeats the one it poisoned: only a replay from the same RNG state hits it again."""

    def __init__(self) -> None:
        super().__init__()
        self.arm = False
        self.target: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.rand(())
        if self.arm:
            self.arm, self.target = False, u.clone()
        if self.target is not None and bool(u == self.target):
            return x * float("nan")
        return x


class DropoutModel(pl.LightningModule):
    def __init__(self, bad_batch: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU())
        self.flaky = _DrawFault()
        self.head = nn.Linear(16, 1)
        self.bad_batch = bad_batch

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.flaky.arm = batch_idx == self.bad_batch and self.flaky.target is None
        return nn.functional.mse_loss(self.head(self.flaky(self.body(batch["x"]))), batch["y"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_replay_of_the_bad_micro_batch_starts_from_its_own_rng(tmp_path):
    """accumulate 4, the fault in micro-batch 3 of window 1 depends on its random draws. Before: the replay ran
    from the window's first RNG state, came out finite and named no module."""
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    t = trainer(tmp_path, [guard], max_steps=2, accumulate_grad_batches=4)
    with pytest.warns(NumGuardWarning):
        t.fit(DropoutModel(bad_batch=6), loader(FaultData()))
    first = guard.events[0]
    assert first["batch_idx"] == 6, first
    assert first["where"][0] == "flaky", first  # the replay found the module
