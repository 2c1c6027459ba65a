"""Spike skipping, rollback and overflow warnings in a real Trainer (``NumGuardCallback(spike_action=...)``)."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import (
    STORE_EVERYTHING_SIZE_GUIDANCE,
    EventAccumulator,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from instruments.op_count import FIRST, count_ops
from instruments.syncs import SyncCounter
from lightning_numguard import NumGuardCallback, NumGuardConfigError
from tests.helpers import FaultData, FaultModel, SyncWindow, all_finite, loader, spike_window, trainer

SPIKE_KINDS = ("loss_spike", "grad_norm_spike")


def regression_data(n: int = 1200, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.5 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Regression(pl.LightningModule):
    """Linear regression, batches of 4 (heavy-tailed per-batch losses); an outlier batch (targets x10 + 30) at
    each step of ``outliers``; fused AdamW (the deferred mode's device skip)."""

    def __init__(self, outliers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)
        self.outliers = outliers

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step in self.outliers:
            y = y * 10 + 30
        loss = nn.functional.mse_loss(self.lin(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


class StepProbe(pl.Callback):
    """The weights and AdamW state before and after chosen steps."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps = steps
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        out = {f"p.{k}": v.detach().clone() for k, v in pl_module.state_dict().items()}
        for i, state in enumerate(trainer.optimizers[0].state.values()):
            out.update({f"s{i}.{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
        return out

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step in self.steps:
            self.before[trainer.global_step] = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step - 1
        if step in self.steps:
            self.after[step] = self._state(trainer, pl_module)


def fit_regression(
    tmp_path: Any, guard: NumGuardCallback, outliers: tuple[int, ...], steps: int = 200, **kwargs: Any
) -> tuple[Regression, SyncCounter, StepProbe, pl.Trainer]:
    torch.manual_seed(0)
    counter = SyncCounter(package="lightning_numguard")
    probe = StepProbe(outliers)
    t = trainer(tmp_path, [SyncWindow(counter), probe, guard], max_steps=steps, **kwargs)
    model = Regression(outliers)
    with counter:
        t.fit(model, DataLoader(regression_data(steps * 4), batch_size=4))
    return model, counter, probe, t


@pytest.mark.parametrize("mode", ["every_step", "deferred"])
def test_an_outlier_batch_is_skipped_atomically_with_no_extra_host_read(tmp_path, mode):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), spike_action="skip", sync_mode=mode, emit_warnings=False)  # type: ignore[arg-type]
    model, counter, probe, t = fit_regression(tmp_path, guard, outliers=(150,))
    spikes = [e for e in guard.events if e["kind"] in SPIKE_KINDS]
    assert spikes and {e["step"] for e in spikes} == {150}, guard.events  # caught at once, nothing else
    assert {e["action"] for e in spikes} == {"skip"}
    assert spikes[0]["details"]["zscore"] > 6
    assert guard.counters["spikes"] == 1 and guard.counters["skipped_steps"] == 1
    before, after = probe.before[150], probe.after[150]
    for key, value in before.items():  # the weights, exp_avg, exp_avg_sq and step: bitwise unchanged
        assert torch.equal(value, after[key]), key
    # one packed read per step, as without spike statistics (none at all in deferred mode)
    assert counter.caused == (200 if mode == "every_step" else 0), counter.sites
    if mode == "every_step":  # the skipped step's logged loss never reached the epoch mean
        outlier = max(e["details"]["value"] for e in spikes if e["kind"] == "loss_spike")
        assert float(t.callback_metrics["train_loss"]) < outlier / 200  # its share of the mean alone is more


@pytest.mark.parametrize("mode", ["every_step", "deferred"])
def test_repeated_spikes_within_the_window_escalate_to_a_rollback(tmp_path, mode):
    guard = NumGuardCallback(
        dirpath=str(tmp_path / "ng"),
        spike_action="skip",
        sync_mode=mode,  # type: ignore[arg-type]
        snapshot_every_n_steps=20,
        skip_batches_after_rollback=2,
        emit_warnings=False,
    )
    model, _, _, _ = fit_regression(tmp_path, guard, outliers=(150, 160, 170), steps=190)
    actions = {e["step"]: e["action"] for e in guard.events if e["kind"] == "loss_spike"}
    assert actions == {150: "skip", 160: "skip", 170: "rollback"}, guard.events
    assert guard.counters["rollbacks"] == 1
    escalated = [e for e in guard.events if e["action"] == "rollback"]
    assert "3 spikes within 128 steps" in escalated[0]["message"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the rollback put back its snapshot's window (taken after the skipped spikes of steps 150 and 160, at most),
    # so the outlier of step 170 is not in it; without that, all three would be
    kept = [v for v in guard.state_dict()["spike"]["window"]["values"][0] if v is not None]
    assert len(kept) == 128 and sum(v > 100 for v in kept) < 3  # losses above 100


class DeepLinear(pl.LightningModule):
    """A deep linear network under plain SGD: with the learning rate raised 100x for steps 120-123 it diverges
    (a finite loss spike at step 121, then Inf and NaN) and never comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 1))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        boost = 100.0 if 120 <= self.global_step < 124 else 1.0
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = 0.01 * boost

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _divergence_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(800, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) * 0.5 + 0.1 * torch.randn(800, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def test_a_learning_rate_blow_up_is_rolled_back_before_it_becomes_nan(tmp_path):
    torch.manual_seed(0)
    plain = DeepLinear()
    trainer(tmp_path / "plain", [], max_steps=160).fit(plain, _divergence_data())
    assert not all(torch.isfinite(p).all() for p in plain.parameters())  # without the guard: NaN weights

    torch.manual_seed(0)
    guarded = DeepLinear()
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), spike_action="rollback", emit_warnings=False)
    trainer(tmp_path / "guarded", [guard], max_steps=160).fit(guarded, _divergence_data())
    assert all(torch.isfinite(p).all() for p in guarded.parameters())
    kinds = {e["kind"] for e in guard.events}
    assert kinds and kinds <= set(SPIKE_KINDS), guard.events  # caught as a spike: no NaN was ever seen
    assert {e["action"] for e in guard.events} == {"rollback"}
    assert 121 <= min(e["step"] for e in guard.events) <= 123  # while the learning rate is still raised
    assert guard.counters["rollbacks"] >= 1


class WindowProbe(pl.Callback):
    """The guard's spike window as the fit starts training (after Lightning restored the callback state)."""

    def __init__(self, guard: NumGuardCallback) -> None:
        self.guard = guard
        self.at_start: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_start = self.guard.state_dict()["spike"]


def test_resume_restores_the_spike_window(tmp_path):
    torch.manual_seed(0)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), spike_action="skip", emit_warnings=False)
    t = trainer(tmp_path, [guard], max_steps=100)  # one whole epoch of 100 batches
    t.fit(Regression(), DataLoader(regression_data(400), batch_size=4))
    ckpt = tmp_path / "at100.ckpt"
    t.save_checkpoint(ckpt)
    saved = guard.state_dict()["spike"]
    assert sum(v is not None for v in saved["window"]["values"][0]) == 100

    resumed = NumGuardCallback(dirpath=str(tmp_path / "ng2"), spike_action="skip", emit_warnings=False)
    probe = WindowProbe(resumed)
    t2 = trainer(tmp_path, [resumed, probe], max_steps=160, max_epochs=5)
    t2.fit(Regression(outliers=(130,)), DataLoader(regression_data(400), batch_size=4), ckpt_path=str(ckpt))
    assert probe.at_start == saved
    # judged from the restored window at once (a fresh one would still be in its 64-step warm-up at step 130)
    assert [(e["kind"], e["step"]) for e in resumed.events if e["kind"] == "loss_spike"] == [("loss_spike", 130)]


def test_a_nan_gradient_mid_window_leaves_statistics_and_optimizer_state_finite(tmp_path):
    guard = NumGuardCallback(
        dirpath=str(tmp_path / "ng"), action="skip", emit_warnings=False, spikes={"window": 8, "warmup": 2}
    )
    model = FaultModel(site="grad", step=3)
    trainer(tmp_path, [guard], max_steps=8).fit(model, loader(FaultData()))
    assert [e["kind"] for e in guard.events] == ["nonfinite_grad"]
    window = spike_window(guard)
    assert window is not None
    assert window.valid() == [8, 7]  # the loss of step 3 was finite; its gradient norm is missing
    scores = window.scores(torch.tensor([0.5, 0.5]))
    assert torch.isfinite(scores).all()
    assert all_finite(model.trainer.optimizers[0].state_dict())


class NormProbe(pl.Callback):
    """The global gradient norm of each step, computed here (listed before the guard)."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.norms[trainer.global_step] = float(torch.cat(grads).norm())


def _scalars(log_dir: str, tag: str) -> dict[int, float]:
    ea = EventAccumulator(log_dir, size_guidance=STORE_EVERYTHING_SIZE_GUIDANCE)
    ea.Reload()
    assert tag in ea.Tags()["scalars"], ea.Tags()["scalars"]
    return {e.step: e.value for e in ea.Scalars(tag)}


def test_grad_norm_zscores_and_spikes_reach_tensorboard_on_lightnings_steps_and_at_each_spike(tmp_path):
    guard = NumGuardCallback(
        dirpath=str(tmp_path / "ng"), spike_action="warn", emit_warnings=False, spikes={"window": 16, "warmup": 8}
    )
    probe = NormProbe()
    logger = TensorBoardLogger(tmp_path, name="tb")
    t = trainer(tmp_path, [probe, guard], max_steps=40, logger=logger, log_every_n_steps=5)
    t.fit(Regression(outliers=(30,)), DataLoader(regression_data(160), batch_size=4))
    spiked = sorted({e["step"] for e in guard.events})
    assert 30 in spiked
    norms = _scalars(logger.log_dir, "numguard/grad_norm")
    # the steps Lightning writes its own metrics at ((step + 1) % 5 == 0), and every step that spiked (issue 27)
    assert sorted(norms) == sorted(set(range(4, 40, 5)) | set(spiked))
    for step, value in norms.items():
        assert value == pytest.approx(probe.norms[step], rel=1e-4)
    zscores = _scalars(logger.log_dir, "numguard/loss_zscore")
    assert sorted(zscores) == sorted(set(range(9, 40, 5)) | set(spiked))  # judged from the 8th value on
    assert zscores[30] > 6  # the outlier step
    spikes = _scalars(logger.log_dir, "numguard/spikes")
    assert spikes[24] == 0 and spikes[34] >= 1


class HalfBlock(pl.LightningModule):
    """A block run in float16 whose outputs peak near ``peak`` (65504 is float16's largest finite value)."""

    def __init__(self, peak: float) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8).half()
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.block.weight.fill_(0.0)
            self.block.weight[:, 0] = peak / 4  # the first feature is 4 in every sample
            self.block.bias.zero_()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch["x"].clone()
        x[:, 0] = 4.0
        hidden = self.block(x.half()).float() / 1e4
        return nn.functional.mse_loss(self.head(hidden), batch["y"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=1e-3)


@pytest.mark.parametrize(("peak", "expected"), [(20000.0, True), (2000.0, False)])
def test_a_float16_block_near_its_limit_is_reported_once_with_its_headroom(tmp_path, peak, expected):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), check_optimizer_coverage="off")
    model = HalfBlock(peak)
    if expected:
        with pytest.warns(UserWarning, match=r"module `block` output reached \|x\| = 20000, within 3\.28x of float16"):
            trainer(tmp_path, [guard], max_steps=6).fit(model, loader(FaultData()))
    else:
        trainer(tmp_path, [guard], max_steps=6).fit(model, loader(FaultData()))
    risks = [e for e in guard.events if e["kind"] == "overflow_risk"]
    if not expected:
        assert risks == []
        return
    assert len(risks) == 1 and risks[0]["where"] == ["block"] and risks[0]["step"] == 0
    assert risks[0]["batch_idx"] == 0 and risks[0]["epoch"] == 0  # the batch it was seen in (issue 27), not -1
    assert risks[0]["details"]["dtype"] == "float16" and risks[0]["details"]["peak"] == pytest.approx(peak, rel=1e-2)
    assert risks[0]["action"] == "none" and "float32" in risks[0]["message"]
    assert guard.counters["incidents"] == 0 and guard.counters["skipped_steps"] == 0  # a warning, not an incident


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spike_action": "halt"}, r"`spike_action` must be one of \['warn', 'skip', 'rollback'\], got 'halt'"),
        ({"spikes": {"sigma": 0}}, r"`spikes.sigma` must be a positive number, got 0"),
        ({"spikes": {"sigma": float("inf")}}, r"`spikes.sigma` must be a positive number, got inf"),
        ({"spikes": {"window": -1}}, r"`spikes.window` must be an integer >= 0, got -1"),
        ({"spike_action": "skip", "spikes": {"window": 0}}, r"needs spike statistics: `spikes.window` must be"),
        (
            {"spikes": {"warmup": 200}},
            r"`spikes.warmup` must be None or an integer in \[1, spikes.window=128\], got 200",
        ),
        ({"spikes": {"rollback_after": -2}}, r"`spikes.rollback_after` must be an integer >= 0, got -2"),
        (
            {"spikes": {"overflow_headroom": 0.5}},
            r"`spikes.overflow_headroom` must be a number >= 1 or None \(off\), got 0.5",
        ),
        ({"action": "warn", "spike_action": "skip"}, r"use action='skip' or 'rollback' with it"),
    ],
)
def test_bad_spike_arguments_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(NumGuardConfigError, match=match):
        NumGuardCallback(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "batch"), [("mlp", 32), ("cnn", 4), ("lm", 2), ("deep", 16)])
def test_a_clean_run_of_each_benchmark_model_raises_no_spike(tmp_path, name, batch):
    """At the default sigma, window and warm-up, over 192 steps (128 judged), with a quarter of each model's batch
    or less: smaller batches make noisier, heavier-tailed losses (the harder case) and a faster test. The deep model
    keeps 24 of its 96 blocks."""
    from instruments.bench_models import build, dataloader

    spec = build(name, n_batches=64)
    spec.batches = [(x[:batch], y[:batch]) for x, y in spec.batches]
    if name == "deep":  # a quarter of its 96 blocks: the same residual family, four times faster
        from instruments.bench_models import BenchModule, DeepNet

        torch.manual_seed(0)
        spec.module = BenchModule(DeepNet(depth=24))
    # the spike statistics need only the loss and the gradients: the other checks stay off to keep this fast
    guard = NumGuardCallback(
        dirpath=str(tmp_path / "ng"), spike_action="warn", emit_warnings=False, check=["loss", "grads"]
    )
    trainer(tmp_path, [guard], max_steps=192, max_epochs=3).fit(spec.module, dataloader(spec))
    window = spike_window(guard)
    assert window is not None and window.valid() == [128, 128]
    assert [e for e in guard.events if e["kind"] != "optimizer_coverage"] == []


def test_with_spike_statistics_off_the_read_carries_nothing_else(tmp_path):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), spikes={"window": 0, "overflow_headroom": None})
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer(tmp_path, [guard], max_steps=4, logger=logger, log_every_n_steps=1).fit(FaultModel(), loader(FaultData()))
    assert guard.state_dict()["spike"] == {"spike_steps": []}  # no window to save
    ea = EventAccumulator(logger.log_dir)
    ea.Reload()
    spike_tags = {"numguard/grad_norm", "numguard/loss_zscore", "numguard/grad_norm_zscore"}
    assert "numguard/incidents" in ea.Tags()["scalars"]  # the counters' series is written, the statistics are not
    assert not spike_tags.intersection(ea.Tags()["scalars"])
    # no extras packed, no norm computed: counted at the dispatcher, the spike statistics launch nothing
    off = count_ops("mlp", {"spikes": {"window": 0, "overflow_headroom": None}}, last=FIRST + 4)
    assert sum(off.by_check.values()) > 0 and off.by_check["spikes"] == 0, dict(off.by_check)
