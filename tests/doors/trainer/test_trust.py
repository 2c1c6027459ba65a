"""Trust (issue 33): the whole run rolls back, no loop, every action has a budget, a fault of the machine is told
from a fault of the code, files outlive the process, writes outside the forward pass are named.

Every case is a real ``Trainer.fit`` on the CPU beside Lightning's own callbacks, with faults as they happen in the
wild: a learning-rate schedule that returns ``inf`` for one step, a NaN loss at every step, an activation flipped to
NaN once by a forward hook (as a flipped bit on a faulty device), a buffer written NaN in ``training_step``.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import socket
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_numguard import NonFiniteError, NumGuardCallback, NumGuardConfigError, SuspectedHardwareError
from lightning_numguard.state.rng import StepRng
from tests.helpers import quiet_trainer

HOST = socket.gethostname()


def _data(batches: int, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = batches * batch_size
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size)


class Net(pl.LightningModule):
    """A two-layer MLP under SGD; ``glitch``: a ``LambdaLR`` returning ``inf`` at that scheduler position (the update
    of that step makes the weights non-finite); ``nan_loss``: the loss is NaN at every step."""

    def __init__(self, glitch: int | None = None, nan_loss: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.register_buffer("temperature", torch.ones(()))
        self.glitch, self.nan_loss = glitch, nan_loss
        self.poison_at: int | None = None  # the step at which training_step writes NaN into the buffer
        self.steps_run = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / self.temperature)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.steps_run += 1
        if self.global_step == self.poison_at:
            self.temperature.fill_(float("nan"))  # a write outside the forward pass
        loss = nn.functional.mse_loss(self(x), y)
        return loss * float("nan") if self.nan_loss else loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        glitch = self.glitch
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: math.inf if e == glitch else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class OwnCopy(pl.Callback):
    """A callback of one's own keeping a running copy of the weights (what ``recovery.restore_callbacks`` restores)."""

    def __init__(self) -> None:
        self.copy: nn.Module | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.copy = copy.deepcopy(pl_module.net)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        assert self.copy is not None
        with torch.no_grad():
            for mine, live in zip(self.copy.parameters(), pl_module.net.parameters()):
                mine.mul_(0.5).add_(live, alpha=0.5)


def _finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


@pytest.mark.parametrize("guard_first", [True, False], ids=["guard-first", "guard-second"])
def test_an_ema_average_never_holds_what_a_rollback_removed_and_the_glitch_rolls_back_at_most_twice(
    tmp_path: Path, guard_first: bool
) -> None:
    """The issue's run: ``EMAWeightAveraging(decay=0.9)``, snapshots every step, a ``LambdaLR`` returning ``inf`` at
    position 4, 14 steps. Before: rolled back at steps 5, 7, 9, 11 and 13, the average non-finite in either order."""
    guard = NumGuardCallback(
        snapshot_every_n_steps=1, dirpath=str(tmp_path), emit_warnings=False, recovery={"restore_callbacks": ["Own*"]}
    )
    ema, own = EMAWeightAveraging(decay=0.9), OwnCopy()
    callbacks = [guard, ema, own] if guard_first else [ema, own, guard]
    model = Net(glitch=4)
    quiet_trainer(callbacks, max_steps=14).fit(model, _data(14))
    average = ema._average_model
    assert average is not None and _finite(average) and own.copy is not None and _finite(own.copy)
    # the final model is the average (EMAWeightAveraging copies it in at the end), and it is finite
    assert all(torch.equal(a, m) for a, m in zip(average.module.parameters(), model.parameters()))
    rollbacks = sorted({e["step"] for e in guard.events if e["action"] == "rollback"})
    assert rollbacks == [5, 7], rollbacks  # the glitch came back once after the first rollback, never after the second
    second = next(e for e in guard.events if e["step"] == 7 and e.get("root_cause", True))
    repeat = second["details"]["repeat"]
    assert repeat["schedule_skipped"]["from"] == [4] and repeat["schedule_skipped"]["to"] == [6]
    assert repeat["schedule_skipped"]["lr_from"] == [math.inf]
    assert "it stays at position 6, lr 0.01, instead of going back to position 4, lr inf" in second["message"]
    assert "nonfinite_param at `net.0.weight` at LR schedule position 5" in second["message"]


class WarmUp(pl.Callback):
    """A learning-rate callback of one's own, written into every parameter group at each batch start (as LitGPT's
    loop does), with a bug at one step: the rate it computes there is ``inf``."""

    def __init__(self, bad_step: int) -> None:
        self.bad_step = bad_step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = math.inf if trainer.global_step == self.bad_step else 0.01


@pytest.mark.filterwarnings("ignore:SWA is currently only supported every epoch")  # Lightning's, for a step schedule
def test_a_stochastic_weight_average_never_holds_what_a_rollback_removed(tmp_path: Path) -> None:
    """``StochasticWeightAveraging`` folds the weights in at each epoch's start, from those the epoch's last step
    left: the bad update of the last step of epoch 0 reached its average before the guard saw it (at epoch 1's first
    step); the rollback puts the average back with the weights (and keeps the ``swa_lr`` SWA put into the parameter
    groups since the snapshot: before, the rollback made SWALR fail with ``KeyError: 'swa_lr'``)."""
    guard = NumGuardCallback(snapshot_every_n_steps=1, dirpath=str(tmp_path), emit_warnings=False)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)  # averages from epoch 1's start on
    model = Net()
    quiet_trainer([WarmUp(bad_step=3), guard, swa], max_epochs=3).fit(model, _data(4))  # 4 batches an epoch
    assert [e["step"] for e in guard.events if e["action"] == "rollback" and e.get("root_cause", True)] == [4]
    average = swa._average_model
    assert average is not None and _finite(average) and _finite(model)
    assert all(torch.equal(a, m) for a, m in zip(average.parameters(), model.parameters()))  # the final model


def test_skip_has_a_budget_and_the_summary_counts_quarantined_batches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NaN loss at every step under ``action="skip"``: before, 20 steps skipped, exit 0, the model trained on
    nothing, the quarantined batches never mentioned. Now the 10th bad step in a row halts."""
    guard = NumGuardCallback(action="skip", dirpath=str(tmp_path), emit_warnings=False)
    with (
        caplog.at_level(logging.WARNING, logger="lightning_numguard"),
        pytest.raises(NonFiniteError, match=r"escalated from 'skip': 10 steps in a row went bad .* none of them"),
    ):
        quiet_trainer([guard], max_steps=20).fit(Net(nan_loss=True), _data(4))
    assert guard.counters["skipped_steps"] == 10  # 4 + 4 incidents (quarantined at the second), 2 quarantined skips
    assert (tmp_path / "last_finite.ckpt").exists()
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("NumGuard: "))
    assert "handled by 10 skipped steps (2 of them quarantined batches, skipped without an incident)" in summary, (
        summary
    )


class Flip:
    """A forward hook flipping one activation of ``net.2`` to NaN on the first call at each step in ``steps`` (the
    replay of the step calls it again and finds it finite): a transient fault of the device."""

    def __init__(self, model: Net, steps: tuple[int, ...]) -> None:
        self.model, self.steps, self.done = model, steps, set[int]()
        model.net[2].register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        step = self.model.global_step
        if step not in self.steps or step in self.done:
            return None
        self.done.add(step)
        out = out.clone()
        out[0, 0] = float("nan")
        return out


def test_a_nan_that_does_not_reproduce_is_a_device_fault_and_repeated_ones_name_the_host(tmp_path: Path) -> None:
    """The issue's flipped activation, at steps 2, 4 and 6: each step's replay ran the same weights, inputs and RNG
    and stayed finite. Before: "look in this module for division by a zero std ...; add an eps". Now each is a
    transient device fault of rank 0 on this host, and the third halts with ``SuspectedHardwareError``."""
    model = Net()
    Flip(model, (2, 4, 6))
    guard = NumGuardCallback(dirpath=str(tmp_path), emit_warnings=False)
    with pytest.raises(SuspectedHardwareError, match=rf"3 device faults on rank 0 \(host {HOST}, device cpu") as err:
        quiet_trainer([guard], max_steps=10).fit(model, _data(10))
    assert isinstance(err.value, NonFiniteError) and (err.value.rank, err.value.host) == (0, HOST)
    assert err.value.device == "cpu" and err.value.faults == 3
    roots = [e for e in guard.events if e.get("root_cause", True)]
    assert [(e["step"], e["kind"], e["where"]) for e in roots] == [
        (s, "nonfinite_output", ["net.2"]) for s in (2, 4, 6)
    ]
    first = roots[0]
    assert first["details"]["reproduced"] is False
    assert first["details"]["device_fault"] == {"verdict": "transient", "rank": 0, "host": HOST, "device": "cpu"}
    assert first["message"].startswith(
        "module `net.2` produced a non-finite output at step 2 on rank 0, which did not reproduce when the step was "
        "re-run with the same weights, inputs and RNG: not a fault of the code or the data; a transient fault of the "
        f"device — rank 0, host {HOST}, device cpu"
    )
    assert "add an eps" not in first["message"] and "clamp" not in first["message"]
    assert [e["action"] for e in roots] == ["rollback", "rollback", "halt"]
    assert guard.state_dict()["device_faults"] == {"0": {"host": HOST, "device": "cpu", "transient": 3}}


class Dice:
    """A forward hook on ``net.2`` drawing from Python's ``random`` at every call: at step ``step`` the first draw
    makes one activation NaN, and so does the same draw again (a step run again from the same Python state): a fault
    of the code, which a replay from the step's RNG state makes again."""

    def __init__(self, model: Net, step: int) -> None:
        self.model, self.step, self.value = model, step, None
        self.made = 0
        model.net[2].register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        draw = random.random()
        if self.model.global_step != self.step or self.made >= 2:
            return None
        if self.value is None:
            self.value = draw
        if draw != self.value:
            return None
        self.made += 1
        out = out.clone()
        out[0, 0] = float("nan")
        return out


@pytest.mark.parametrize("seen_drawing", [True, False])
def test_a_fault_of_a_python_random_draw_reproduces_from_the_kept_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seen_drawing: bool
) -> None:
    """A step drawing from Python's ``random``: the guard sees the fit draw on its first steps and keeps Python's
    state at every step's start, so the step's replay draws the same number, makes the NaN again, and the verdict
    is the code's, not the device's. Had the draws gone unseen (no probe, no recheck), the step kept torch's state
    alone: the replay draws another number and stays finite, which proves nothing, so no device is blamed."""
    if not seen_drawing:
        monkeypatch.setattr(StepRng, "PROBE", 0)
        monkeypatch.setattr(StepRng, "RECHECK", 10**9)
    model = Net()
    dice = Dice(model, step=5)
    guard = NumGuardCallback(dirpath=str(tmp_path), emit_warnings=False)
    quiet_trainer([guard], max_steps=8).fit(model, _data(8))
    root = next(e for e in guard.events if e.get("root_cause", True))
    assert (root["step"], root["kind"], root["where"]) == (5, "nonfinite_output", ["net.2"])
    if seen_drawing:
        assert dice.made == 2  # the step and its replay
        assert root["details"]["reproduced"] is True and "device_fault" not in root["details"]
        assert "op `__setitem__`" in root["message"] and "did not reproduce" not in root["message"]
    else:
        assert dice.made == 1
        assert "device_fault" not in root["details"] and "reproduced" not in root["details"]
        assert "Python's random" in root["details"]["replay"]["unsure"]
        assert "transient fault of the device" not in root["message"]
    assert guard.state_dict()["device_faults"] == {}


def test_a_dirpath_that_is_a_file_fails_before_the_first_step(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    model = Net()
    for dirpath in (blocker, blocker / "numguard"):
        with pytest.raises(NumGuardConfigError, match=rf"`dirpath`.*{str(blocker)!r}.* is a file"):
            quiet_trainer([NumGuardCallback(dirpath=str(dirpath))], max_steps=3).fit(model, _data(3))
    assert model.steps_run == 0


def test_a_halt_writes_its_files_even_when_the_run_writes_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No logger, no checkpointing, no ``dirpath``, run from the working directory (zero-code attach's usual case):
    before, "the last finite state was restored in memory", lost with the process."""
    monkeypatch.chdir(tmp_path)
    guard = NumGuardCallback(action="halt", emit_warnings=False)
    folder = tmp_path / "numguard"
    with pytest.raises(NonFiniteError, match=rf"The last finite state is in {folder / 'last_finite.ckpt'} \(events: "):
        quiet_trainer([guard], max_steps=3).fit(Net(nan_loss=True), _data(3))
    assert (folder / "last_finite.ckpt").exists()
    assert [line for line in (folder / "events.jsonl").read_text().splitlines() if '"halt"' in line]


def test_a_nan_written_into_a_buffer_in_training_step_is_named_with_its_write(tmp_path: Path) -> None:
    """``self.temperature.fill_(nan)`` in ``training_step`` before the forward pass: before, "the replay found the
    forward pass's inputs already non-finite ... look at what training_step does before calling it"."""
    model = Net()
    model.poison_at = 2
    guard = NumGuardCallback(dirpath=str(tmp_path), emit_warnings=False)
    quiet_trainer([guard], max_steps=4).fit(model, _data(4))
    root = next(e for e in guard.events if e.get("root_cause", True))
    assert root["op"] == "fill_" and root["source"].endswith(f"test_trust.py:{_line_of('fill_(float')}")
    assert root["details"]["replay"]["written"] == {"source": "buffer", "name": "temperature"}
    assert "writing a NaN/Inf literal into buffer `temperature`" in root["message"], root["message"]


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "def " not in line)


class HookWrites(Net):
    """Writes a negative value into a buffer in the module's own ``on_train_batch_start``, which runs after the
    guard's batch start and which a replay of the step does not run again; the forward pass takes its root."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * torch.sqrt(self.temperature))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == 2:
            self.temperature.fill_(-1.0)


def test_a_buffer_written_in_a_hook_before_the_forward_is_no_fault_of_the_device(tmp_path: Path) -> None:
    """The replay from the step's start buffers stays finite (the hook's write is not made again); from the live
    buffers it makes the NaN: the code's, named at its op and line, never a transient fault of the device."""
    model = HookWrites()
    guard = NumGuardCallback(dirpath=str(tmp_path), action="skip", emit_warnings=False)
    quiet_trainer([guard], max_steps=4).fit(model, _data(4))
    root = next(e for e in guard.events if e.get("root_cause", True))
    assert root["step"] == 2 and root["op"] == "sqrt", root
    assert "device_fault" not in root["details"] and root["details"].get("reproduced") is not False, root["details"]
    assert "transient fault of the device" not in root["message"]


class FusedNet(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)  # sync_mode="deferred" skips through it


def test_a_nan_written_into_a_buffer_read_one_step_late_says_a_buffer_was_written(tmp_path: Path) -> None:
    """The same write under ``sync_mode="deferred"``: the step is read one step late, gone by then, and the device
    skip put the buffer back; its kept totals still say a buffer went bad during the step, the weights and the
    buffers it started from finite. Before: the generic advice for the first module ("look in this module for
    division by a zero std ...")."""
    model = FusedNet()
    model.poison_at = 2
    guard = NumGuardCallback(dirpath=str(tmp_path), sync_mode="deferred", emit_warnings=False)
    quiet_trainer([guard], max_steps=5).fit(model, _data(5))
    root = next(e for e in guard.events if e.get("root_cause", True))
    assert root["step"] == 2 and root["details"]["deferred"] is True and root["details"]["buffer_written"] is True
    assert "a buffer went non-finite during this step" in root["message"], root["message"]
    assert 'sync_mode="every_step" to name them' in root["message"]
    assert "division by a zero std" not in root["message"]
    assert _finite(model) and bool(torch.isfinite(model.temperature))
