"""One process's read reduces the per-tensor, per-call and per-record values on the host (``engine/tail.Tail``):
the same answers as the device reductions that the read of several ranks and the deferred read make."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch

from lightning_numguard.callbacks import NumGuardCallback
from lightning_numguard.detect import checks, flags
from lightning_numguard.engine.tail import Tail
from tests.helpers import FaultData, FaultModel, loader, spike_window, trainer

CPU = torch.device("cpu")
F32_MAX = torch.finfo(torch.float32).max


def _host_input(tensors: list[torch.Tensor]) -> float:
    tail = Tail()
    tail.add_inputs(checks.input_ends(tensors, CPU), CPU)
    values = [0.0] * len(flags.SLOTS) + (torch.stack(tail.values).tolist() if tail.values else [])
    tail.fold(values, len(flags.SLOTS), suspicious=True)
    assert values[flags.SUSPICIOUS] == values[flags.INPUT] or math.isnan(values[flags.INPUT])
    return values[flags.INPUT]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "mask",  # an additive attention mask: finfo.min is left out
        "fill",  # numpy's 1e20 fill value is no dtype's extreme: it counts
        "nan",
        "inf",
        "half",  # another dtype: reduced on the device first
        "double",
        "mixed",
        "empty",
    ],
)
def test_the_hosts_unmasked_input_max_is_the_devices(case):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=g)
    mask = torch.zeros(4, 5)
    mask[:, 3:] = torch.finfo(torch.float32).min
    tensors = {
        "plain": [x, -3 * x],
        "mask": [x, mask],
        "fill": [x, torch.where(mask < 0, torch.tensor(1e20), mask)],
        "nan": [x, torch.tensor([1.0, math.nan])],
        "inf": [x, torch.tensor([1.0, -math.inf])],
        "half": [x.half(), torch.full((3,), torch.finfo(torch.float16).max).half()],
        "double": [x.double() * 1e100],
        "mixed": [x, mask, x.bfloat16() * 7, torch.tensor([2e300], dtype=torch.float64)],
        "empty": [torch.zeros(0)],
    }[case]
    device = checks.unmasked_of(checks.input_ends(tensors, CPU), CPU).item()
    assert _same(_host_input(tensors), device), (case, _host_input(tensors), device)


def test_the_hosts_global_norm_is_the_norm_of_the_tensors_norms_and_nan_when_one_is_not_finite():
    norms = [torch.tensor(v) for v in (3.0, 4.0, 12.0)]
    tail = Tail()
    tail.add_norms(norms)
    values = [0.0] * len(flags.SLOTS) + torch.stack(tail.values).tolist()
    tail.fold(values, len(flags.SLOTS), suspicious=False)
    assert tail.grad_norm == 13.0 and values[flags.NORMS] == 0.0  # every value finite: the slot keeps its own
    assert not flags.decode_raw(values[: len(flags.SLOTS)]).seen(flags.NORMS)

    for bad in (math.nan, math.inf):
        tail = Tail()
        tail.add_norms([norms[0], torch.tensor(bad)])
        values = [0.0] * len(flags.SLOTS) + torch.stack(tail.values).tolist()
        tail.fold(values, len(flags.SLOTS), suspicious=False)
        assert math.isnan(values[flags.NORMS]) and not math.isfinite(tail.grad_norm)
        assert flags.decode_raw(values[: len(flags.SLOTS)]).seen(flags.NORMS)


def test_an_op_flag_in_the_tail_is_seen_and_only_its_slot():
    tail = Tail()
    tail.add_norms([torch.tensor(2.0)])
    tail.add_step(_NoRecord(), None, [torch.tensor(False), torch.tensor(True)], CPU)
    values = [0.0] * len(flags.SLOTS) + torch.stack(tail.values).tolist()
    tail.fold(values, len(flags.SLOTS), suspicious=False)
    seen = flags.decode_raw(values[: len(flags.SLOTS)])
    assert [flags.SLOTS[i] for i in range(len(flags.SLOTS)) if seen.seen(i)] == ["op"]
    assert tail.grad_norm == 2.0


class _NoRecord:
    """A step record with no input recorded."""

    def __init__(self) -> None:
        self.inputs: list = []


def test_a_state_total_that_is_not_finite_stays_seen_when_the_gradients_norms_join_its_slot():
    tail = Tail()
    tail.add_norms([torch.tensor(1.0)])
    values = [0.0] * len(flags.SLOTS) + torch.stack(tail.values).tolist()
    values[flags.NORMS] = -math.inf  # the CPU's fused state check marks a non-finite tensor with -inf
    tail.fold(values, len(flags.SLOTS), suspicious=False)
    assert not math.isfinite(values[flags.NORMS])
    assert flags.decode_raw(values[: len(flags.SLOTS)]).seen(flags.NORMS)
    values = [0.0] * len(flags.SLOTS) + [math.nan]  # and a gradient's norm that is not finite: NaN
    values[flags.NORMS] = -math.inf
    tail.fold(values, len(flags.SLOTS), suspicious=False)
    assert math.isnan(values[flags.NORMS])


class _TotalNorm(pl.Callback):
    """The gradients' global L2 norm before each optimizer step, as ``clip_grad_norm_`` computes it."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_the_spike_window_holds_each_steps_global_gradient_norm_and_loss_taken_on_the_host(tmp_path):
    norms = _TotalNorm()
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    model = FaultModel()
    trainer(tmp_path, [guard, norms], max_steps=6).fit(model, loader(FaultData()))
    window = spike_window(guard)
    assert window is not None and window.count == 6
    kept = window.values[: window.count].tolist()  # rows in push order: the window is longer than the fit
    assert [row[1] for row in kept] == pytest.approx(norms.norms, rel=1e-6)
    assert [row[0] for row in kept] == pytest.approx(norms.losses, rel=1e-6)


class _Blocks(torch.nn.Module):
    """Three watched blocks: ``low`` (float16, called twice), ``wide`` (float32) and ``bad`` (float16, NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.low = torch.nn.Identity()
        self.wide = torch.nn.Identity()
        self.bad = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.low(x.half() * 3000)  # 12000: 0.18 of float16's limit
        b = self.low(x.half() * 5000)  # the same block again, larger: its largest call counts
        c = self.wide(x * 1e37)  # 0.012 of float32's
        d = self.bad(torch.full_like(x, math.nan).half())  # non-finite: the NaN guard's, never the headroom's
        return a.float() + b.float() + c + d.float()


@pytest.mark.parametrize("reported", [set(), {"low"}])
def test_the_hosts_headroom_of_the_read_values_is_the_devices(reported):
    from lightning_numguard.detect.spike import headroom
    from lightning_numguard.detect.spike_guard import SpikeGuard
    from lightning_numguard.detect.watch import OutputWatch

    model = _Blocks()
    watch = OutputWatch(model)
    watch.attach()
    with torch.enable_grad():
        model(torch.full((2, 3), 4.0, requires_grad=True))
    values = torch.stack(watch.values(CPU)).tolist()  # what one process's read holds
    guard = SpikeGuard(None, 6.0, 0, 1, 0, headroom=100.0)
    guard.reported = set(reported)
    ratio, index = guard.host_headroom(watch.host_ranges(values), watch.names)
    ranges = [(key, rows) for key, rows in watch.ranges() if key[1] in (torch.float16, torch.float32)]
    masks = [torch.tensor([name in reported for name in watch.names]) for _ in ranges]
    device_ratio, device_index = headroom([(key[1], rows) for key, rows in ranges], masks, 100.0)
    assert index == device_index.item()
    assert ratio == pytest.approx(device_ratio.item(), rel=1e-6)
    layout = [(key, rows.shape[0]) for key, rows in ranges]
    assert guard._layout == layout  # the index means the same block in the overflow finding
    n = len(watch.names)
    expected = 20000 / 65504 if not reported else 4e37 / float(torch.finfo(torch.float32).max)
    assert ratio == pytest.approx(expected, rel=1e-3)
    name = watch.names[int(index) % n]
    assert name == ("wide" if reported else "low")
