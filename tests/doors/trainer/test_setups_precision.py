"""fp16 with a real GradScaler: its counters and loss scale reach TensorBoard; the snapshot does not sync it."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.plugins import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import (
    STORE_EVERYTHING_SIZE_GUIDANCE,
    EventAccumulator,
)

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from lightning_numguard.state.stateful import PrecisionState
from tests.helpers import FaultData, FaultModel, loader, trainer


def fp16(init_scale: float = 2.0**16) -> list[MixedPrecision]:
    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]


def _scalars(log_dir: str, tag: str) -> list[tuple[int, float]]:
    ea = EventAccumulator(log_dir, size_guidance=STORE_EVERYTHING_SIZE_GUIDANCE)
    ea.Reload()
    assert tag in ea.Tags()["scalars"], ea.Tags()["scalars"]
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def test_fp16_overflow_steps_and_loss_scale_reach_tensorboard(tmp_path):
    """An overflow at step 3 (the scaler's business, not an incident): before, the tags were never written."""
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    logger = TensorBoardLogger(tmp_path, name="tb")
    t = trainer(tmp_path, [guard], max_steps=6, plugins=fp16(1024.0), logger=logger, log_every_n_steps=1)
    t.fit(FaultModel(site="grad", step=3), loader(FaultData()))
    assert guard.counters["amp_overflow_steps"] == 1 and not guard.events
    overflow = _scalars(logger.log_dir, "numguard/amp_overflow_steps")
    scale = _scalars(logger.log_dir, "numguard/loss_scale")
    assert [v for _, v in overflow] == [0, 0, 0, 1, 1, 1]
    assert scale[0][1] == 1024.0 and scale[-1][1] == 512.0  # the scaler backed off once


class AlwaysInfGrad(FaultModel):
    def _armed(self) -> bool:
        return True


# torch's remark when the GradScaler skips the first optimizer step (what this test makes it do), not the guard's
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_collapsing_loss_scale_is_said_once(tmp_path):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    t = trainer(tmp_path, [guard], max_steps=6, plugins=fp16(init_scale=4.0))
    with pytest.warns(NumGuardWarning, match=r"loss scale has collapsed to 0\.5") as records:
        t.fit(AlwaysInfGrad(site="grad"), loader(FaultData()))
    assert sum("collapsed" in str(r.message) for r in records) == 1
    assert guard.counters["amp_overflow_steps"] == 6


def test_the_scaler_snapshot_copies_tensors_without_a_host_read(tmp_path):
    plugin = fp16(init_scale=8.0)[0]
    plugin.scaler.scale(torch.ones(()))  # creates the scale and growth tracker tensors
    adapter = PrecisionState(plugin)
    saved = {k: v.clone() for k, v in adapter.state_dict().items()}
    assert set(saved) == {"scale_tensor", "growth_tracker_tensor"}
    plugin.scaler.update(new_scale=2.0)
    adapter.load_state_dict(saved)
    assert plugin.scaler.get_scale() == 8.0


class ScaledData(FaultData):
    """Finite inputs of a magnitude only a wide dtype holds (``scale``), NaN in ``bad_batch``."""

    def __init__(self, scale: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.x = self.x.double() * scale
        self.y = self.y.double()


@pytest.mark.parametrize(
    ("precision", "scale"),
    [("64-true", 1e17), ("bf16-mixed", 1e17), ("32-true", 1e17)],
)
def test_large_finite_values_are_no_alarm_and_a_nan_is_caught(tmp_path, precision, scale):
    """Values whose squares are near the float32 limit (an L2 norm would overflow): no alarm; a NaN is caught.

    Float64 values beyond float32's range (1e100): see the next test.
    """
    for bad_batch in (None, 3):
        guard = NumGuardCallback(dirpath=str(tmp_path / f"ng{bad_batch}"), max_abs_input=None)
        t = trainer(tmp_path, [guard], max_steps=5, precision=precision)
        data = ScaledData(scale if precision == "64-true" else 1.0, bad_batch=bad_batch, site="input")
        if precision != "64-true":
            data.x, data.y = data.x.float(), data.y.float()
            data.x[:8] *= scale  # a large finite batch the model still maps to finite outputs in this dtype
        model = FaultModel(lr=0.0)
        if bad_batch is None:
            t.fit(model, loader(data))
            assert not guard.events, guard.events
        else:
            with pytest.warns(NumGuardWarning, match=r"batch\['x'\]"):
                t.fit(model, loader(data))
            assert guard.events[0]["kind"] == "nonfinite_input" and guard.events[0]["step"] == 3


def test_float64_values_beyond_float32_range_are_no_false_nonfinite(tmp_path):
    """64-true: 1e100 is finite. Before: the float32 cast of the input max made it a false ``nonfinite_input``."""
    guard = NumGuardCallback(action="warn", dirpath=str(tmp_path / "warn"), emit_warnings=False)
    trainer(tmp_path, [guard], max_steps=3, precision="64-true").fit(FaultModel(lr=0.0), loader(ScaledData(1e100)))
    assert [e["kind"] for e in guard.events] == ["suspicious_input"] * 3  # above max_abs_input: correct
    for bad_batch in (None, 2):
        guard = NumGuardCallback(dirpath=str(tmp_path / f"ng{bad_batch}"), max_abs_input=None)
        data = ScaledData(1e100, bad_batch=bad_batch, site="input")
        if bad_batch is None:
            trainer(tmp_path, [guard], max_steps=3, precision="64-true").fit(FaultModel(lr=0.0), loader(data))
            assert guard.events == []
        else:
            with pytest.warns(NumGuardWarning, match=r"batch\['x'\]"):
                trainer(tmp_path, [guard], max_steps=3, precision="64-true").fit(FaultModel(lr=0.0), loader(data))
            assert (guard.events[0]["kind"], guard.events[0]["step"]) == ("nonfinite_input", 2)


class BigBufferModel(FaultModel):
    """A float64 buffer and weight holding 1e100: finite, but their float32 norms overflow to ``inf``."""

    def __init__(self) -> None:
        super().__init__(lr=0.0)
        self.register_buffer("big", torch.full((4,), 1e100, dtype=torch.float64))
        self.far = torch.nn.Parameter(torch.full((4,), 1e100, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.0 * self.far.sum()


def test_float64_state_beyond_float32_range_is_confirmed_finite(tmp_path):
    """The norm path: a float32 norm of 1e100 is an ``inf`` candidate, confirmed finite exactly after the read."""
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), check=["loss", "grads", "params", "buffers"])
    model = BigBufferModel()
    trainer(tmp_path, [guard], max_steps=4, precision="64-true").fit(model, loader(FaultData()))
    assert guard.events == [] and guard.counters["skipped_steps"] == 0
    assert model.big.dtype == torch.float64 and float(model.far[0].detach()) == 1e100  # the steps were not rolled back
