"""Precisions x optimization modes on one device: a NaN at a chosen step is caught, named, rolled back.

Each case runs a guard-free reference and a guarded run with one fault; the guarded run survives with
finite weights and the reference's ``global_step``. 16-mixed runs under a real ``GradScaler`` on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.plugins import MixedPrecision
from pytorch_lightning.strategies import Strategy
from torch import nn
from typing_extensions import override

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.doors.trainer.test_setups_retry import CountingGAN
from tests.helpers import FaultData, FaultModel, all_finite, guard_warns, loader, trainer

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "64-true")


def precision_args(precision: str, init_scale: float = 2.0**10) -> dict[str, Any]:
    """Trainer arguments for ``precision``; 16-mixed gets a real CPU GradScaler."""
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": precision}


def fit(
    tmp_path: Any, model: pl.LightningModule, data: FaultData, callbacks: list[Any], precision: str, **kwargs: Any
) -> pl.Trainer:
    torch.manual_seed(0)
    t = trainer(
        tmp_path, callbacks, max_epochs=1, **precision_args(precision, kwargs.pop("init_scale", 2.0**10)), **kwargs
    )
    t.fit(model, loader(data))
    return t


@pytest.mark.parametrize("precision", PRECISIONS)
def test_accumulation_names_and_rolls_back_the_bad_micro_batch(tmp_path, precision):
    """accumulate 2: batch 3 (window 1's second micro-batch) is NaN; the event names batch 3 at step 1."""
    ref = fit(tmp_path / "ref", FaultModel(), FaultData(), [], precision, accumulate_grad_batches=2)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    model = FaultModel()
    with pytest.warns(NumGuardWarning, match=r"batch\['x'\]` at step 1"):
        t = fit(tmp_path / "ng", model, FaultData(bad_batch=3), [guard], precision, accumulate_grad_batches=2)
    first = guard.events[0]
    assert first["kind"] == "nonfinite_input" and first["batch_idx"] == 3 and first["step"] == 1, first
    assert first["where"] == ["batch['x']"]
    assert {e["batch_idx"] for e in guard.events} == {3}
    assert guard.counters["rollbacks"] == 1 and guard.counters["skipped_steps"] == 1
    assert guard.counters["amp_overflow_steps"] == 0  # a NaN input is an incident, never the scaler's overflow
    assert t.global_step == ref.global_step == 4
    assert all_finite(model.state_dict())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_manual_gan_names_the_discriminator_loss_and_rolls_back(tmp_path, precision):
    """Two optimizers per batch, through Lightning's wrappers (``manual_backward``, ``opt.step()``; under fp16 the
    GradScaler's). The discriminator's loss is NaN at batch 2: read at its optimizer's step (global step 5)."""
    ref = fit(tmp_path / "ref", CountingGAN(), FaultData(n=48), [], precision)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))  # the default replay: it steps no optimizer
    model = CountingGAN(bad_batch=2)
    with pytest.warns(NumGuardWarning, match="the loss is non-finite at step 5"):
        t = fit(tmp_path / "ng", model, FaultData(n=48), [guard], precision)
    first = guard.events[0]
    assert first["kind"] == "nonfinite_loss" and first["batch_idx"] == 2 and first["step"] == 5, first
    assert [e["where"] for e in guard.events[1:]] == [["disc.weight", "disc.bias"]]  # the discriminator's grads
    assert "`mul` at" in first["message"] and "test_setups_accumulation.py" in first["message"]  # the replay's op
    assert guard.counters["rollbacks"] == 1 and guard.counters["skipped_steps"] == 1
    assert guard.counters["amp_overflow_steps"] == 0
    assert t.global_step == ref.global_step == 12
    assert model.steps[0] == 6 and model.steps[1] <= 6  # no step taken by the replay
    assert all_finite(model.state_dict())


@pytest.mark.parametrize("bad_batch", [None, 4])
def test_manual_fp16_overflow_is_the_scalers_and_a_nan_is_an_incident(tmp_path, bad_batch):
    """Under ``manual_backward`` and the scaler's ``opt.step()``: a loss scale of 2**30 overflows the fp16
    gradients of finite losses; those steps are the scaler's (skipped and counted by it, no incident). A real
    NaN loss among them is still an incident."""
    ref = fit(tmp_path / "ref", CountingGAN(), FaultData(n=48), [], "16-mixed", init_scale=2.0**30)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), emit_warnings=False)  # this test reads the events
    model = CountingGAN(bad_batch)
    t = fit(tmp_path / "ng", model, FaultData(n=48), [guard], "16-mixed", init_scale=2.0**30)
    assert guard.counters["amp_overflow_steps"] >= 1
    assert t.global_step == ref.global_step == 12
    assert [e["batch_idx"] for e in guard.events if e["kind"] == "nonfinite_loss"] == ([] if bad_batch is None else [4])
    assert guard.counters["incidents"] == (0 if bad_batch is None else 1)
    assert all_finite(model.state_dict())


class LogHead(nn.Module):
    """``lin(x) + log1p(shift)``: NaN inside the module when its ``shift`` tensor is set below -1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)
        self.shift = torch.zeros(())  # not a buffer: DDP would broadcast rank 0's over a fault on rank 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.log1p(self.shift)


class CompiledLogHeadModel(FaultModel):
    """The head is compiled (``backend="eager"``: dynamo without codegen); batch 3 makes it NaN from inside
    (on ``rank`` only, when given)."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.head = LogHead()
        self.bad_rank = rank

    def configure_model(self) -> None:
        self.head = torch.compile(self.head, backend="eager")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        bad = batch_idx == 3 and self.bad_rank in (None, self.global_rank)
        self.head.shift.fill_(-2.0 if bad else 0.0)  # a tensor: a graph input, no recompile


class CompiledGAN(CountingGAN):
    """The two-optimizer GAN with its discriminator compiled; its loss is NaN at ``bad_batch``."""

    def configure_model(self) -> None:
        self.disc = torch.compile(self.disc, backend="eager")


@pytest.fixture
def dynamo() -> Any:
    dynamo = pytest.importorskip("torch._dynamo")
    dynamo.reset()
    dynamo.utils.counters.clear()
    yield dynamo
    assert dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it really compiled
    assert not dynamo.utils.counters["graph_break"], dict(dynamo.utils.counters["graph_break"])


@pytest.mark.parametrize(("accumulate", "step"), [(1, 3), (2, 1)])
def test_a_nan_inside_a_compiled_module_is_caught_at_its_boundary_and_rolled_back(tmp_path, dynamo, accumulate, step):
    """Each step the guard sees a compiled region from outside: its module's output (``head``), not the ops inside.
    After the hit, the replay runs the compiled module eagerly (``torch.compiler.set_stance("force_eager")``,
    torch >= 2.6) and names the op, ``log1p``; before, it named the module only. The step is rolled back, the run
    survives, and the compiled graph has no graph break. With ``accumulate_grad_batches=2`` batch 3 is window 1's
    second micro-batch."""
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    model = CompiledLogHeadModel()
    t = trainer(tmp_path, [guard], max_steps=6 // accumulate, accumulate_grad_batches=accumulate)
    with pytest.warns(NumGuardWarning, match=f"module `head.*` produced the first non-finite output at step {step}"):
        t.fit(model, loader(FaultData()))
    first = guard.events[0]
    assert first["kind"] == "nonfinite_output" and first["step"] == step and first["batch_idx"] == 3, first
    if hasattr(torch.compiler, "set_stance"):
        # named as in the model's state_dict: the compiled wrapper's original module is ``head._orig_mod``
        assert first["where"] == ["head._orig_mod"] and "op `log1p` in `head._orig_mod`" in first["message"], first
    else:
        assert first["where"] == ["head"], first
    assert guard.counters["rollbacks"] == 1 and guard.counters["skipped_steps"] == 1
    assert t.global_step == 6 // accumulate and all_finite(model.state_dict())


def test_a_compiled_gan_under_manual_optimization_is_rolled_back(tmp_path, dynamo):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    model = CompiledGAN(bad_batch=2)
    t = trainer(tmp_path, [guard], max_epochs=1)
    with pytest.warns(NumGuardWarning, match="the loss is non-finite at step 5"):
        t.fit(model, loader(FaultData(n=48)))
    first = guard.events[0]
    assert first["kind"] == "nonfinite_loss" and first["batch_idx"] == 2, first
    assert guard.counters["rollbacks"] == 1 and guard.counters["skipped_steps"] == 1
    assert t.global_step == 12 and model.steps[0] == 6 and all_finite(model.state_dict())


class OwnStrategy(Strategy):
    """A user's own single-process strategy, built on ``Strategy`` directly: not one the guard knows."""

    def __init__(self) -> None:
        super().__init__(accelerator=CPUAccelerator())
        self.global_rank, self.local_rank, self.world_size = 0, 0, 1

    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    @override
    def is_global_zero(self) -> bool:
        return True

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


def test_an_unknown_strategy_is_said_at_setup_and_a_single_process_rollback_works(tmp_path):
    """Not refused: a warning at setup says recovery assumes every rank holds the full state; on one process
    a NaN batch is still caught and rolled back."""
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    model = FaultModel()
    t = trainer(tmp_path, [guard], strategy=OwnStrategy(), accelerator="auto", devices="auto", max_steps=6)
    with guard_warns(r"has not been tested under OwnStrategy: .*Check a rollback") as records:
        t.fit(model, loader(FaultData(bad_batch=3)))
    assert any("non-finite value in `batch['x']` at step 3" in str(r.message) for r in records)
    first = guard.events[0]
    assert first["kind"] == "nonfinite_input" and first["batch_idx"] == 3, first
    assert guard.counters["rollbacks"] == 1 and t.global_step == 6 and all_finite(model.state_dict())
