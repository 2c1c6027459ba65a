"""``retry_transient`` only judges: it steps no optimizer, moves no counter, and runs under autocast."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pytorch_lightning.plugins import MixedPrecision

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.doors.trainer.test_setups_accumulation import TwoOptimizerGAN
from tests.helpers import FaultData, FaultModel, loader, trainer


class CountingGAN(TwoOptimizerGAN):
    """Counts each torch optimizer's ``step`` calls; with ``once`` its NaN happens on the first try only."""

    def __init__(self, bad_batch: int | None = None, once: bool = False) -> None:
        super().__init__(bad_batch)
        self.once = once
        self.steps = [0, 0]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        if self.once and batch_idx == self.bad_batch:
            self.bad_batch = None  # the retry of this batch is finite

    def configure_optimizers(self) -> Any:
        opts = super().configure_optimizers()
        for i, opt in enumerate(opts):
            opt.register_step_pre_hook(lambda *_, i=i: self.steps.__setitem__(i, self.steps[i] + 1))
        return opts


@pytest.mark.parametrize("once", [False, True])
def test_retry_under_manual_optimization_steps_nothing(tmp_path, once):
    """Before: the retry's ``training_step`` stepped both optimizers (7 steps each) and moved global_step to 14."""
    torch.manual_seed(0)
    ref = trainer(tmp_path / "ref", [], max_epochs=1)
    ref.fit(CountingGAN(), loader(FaultData(n=48)))
    guard = NumGuardCallback(
        dirpath=str(tmp_path / "ng"), emit_warnings=False, recovery={"replay": False, "retry_transient": True}
    )
    model = CountingGAN(bad_batch=2, once=once)
    t = trainer(tmp_path / "ng", [guard], max_epochs=1)
    torch.manual_seed(0)
    t.fit(model, loader(FaultData(n=48)))
    assert t.global_step == ref.global_step == 12
    assert model.steps == [6, 6]  # one step per optimizer per batch: none during the retry
    retry = guard.events[0]["details"]["retry"]
    assert retry == ("transient: finite on retry" if once else "persistent: non-finite again")
    assert [q["batch_idx"] for q in guard.quarantined] == ([] if once else [2])


class Fp16OverflowData(FaultData):
    """Batch 3 is finite but large: its first layer's output overflows float16 (above 65504), not float32."""

    def __init__(self) -> None:
        super().__init__(n=48)
        self.x[24:32] *= 1e5


def test_retry_runs_under_autocast(tmp_path):
    """A fault that only happens in fp16 is persistent. Before: the retry ran in float32, found it finite."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), recovery={"replay": False, "retry_transient": True})
    t = trainer(tmp_path, [guard], max_epochs=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    with pytest.warns(NumGuardWarning):
        t.fit(FaultModel(), loader(Fp16OverflowData()))
    first = guard.events[0]
    assert first["batch_idx"] == 3 and first["details"]["retry"] == "persistent: non-finite again", first
    assert [q["batch_idx"] for q in guard.quarantined] == [3]
