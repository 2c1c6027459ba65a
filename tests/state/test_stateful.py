"""State adapters (torchmetrics, numpy's RNG, a precision plugin) and the LR back-off, without Lightning."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import torch
import torchmetrics

from lightning_numguard.state.snapshot import capture, restore
from lightning_numguard.state.stateful import MetricState, NumpyRNG, PrecisionState, apply_lr_backoff, clone_states


def test_metric_state_round_trip_restores_the_accumulation_and_the_cache():
    metric = torchmetrics.MeanSquaredError()
    metric.update(torch.ones(3), torch.zeros(3))
    adapter = MetricState(metric)
    saved = clone_states({"m": adapter}, ["m"])["m"]
    expected = float(metric.compute())
    metric.update(torch.full((3,), float("nan")), torch.zeros(3))
    assert metric.update_count == 2
    adapter.load_state_dict(saved)
    assert metric.update_count == 1
    assert float(metric.compute()) == expected
    assert adapter.state_dict()["update_count"] == 1
    assert set(adapter.state_dict()["states"]) == {"sum_squared_error", "total"}


def test_numpy_rng_round_trip():
    rng = NumpyRNG()
    state = rng.state_dict()
    first = np.random.rand(3)
    rng.load_state_dict(state)
    assert np.array_equal(np.random.rand(3), first)


class Plugin:
    """Stands in for a precision plugin: state_dict/load_state_dict of a GradScaler-like state."""

    def __init__(self) -> None:
        self.state = {"scale": 1024.0, "_growth_tracker": 3}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_precision_state_round_trip():
    plugin = Plugin()
    adapter = PrecisionState(plugin)
    saved = adapter.state_dict()
    plugin.state["scale"] = 1.0
    adapter.load_state_dict(saved)
    assert plugin.state == {"scale": 1024.0, "_growth_tracker": 3}
    assert pickle.loads(pickle.dumps(adapter)).state_dict() == saved


def test_snapshot_restores_every_adapter_bitwise():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    metric = torchmetrics.MeanMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    stateful = {"metric": MetricState(metric), "numpy_rng": NumpyRNG()}
    snap = capture(model, [opt], stateful, step=0)
    metric.update(torch.tensor([100.0]))
    np.random.rand()
    restore(snap, model, [opt], stateful)
    assert float(metric.compute()) == 1.5


def test_lr_backoff_scales_param_groups_and_scheduler_base_rates():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    before = copy.deepcopy(sched.base_lrs)
    lrs = apply_lr_backoff([opt], [sched], 0.5)
    assert lrs == [0.05]
    assert sched.base_lrs == [b * 0.5 for b in before]
    assert sched.get_last_lr() == [0.05]
    opt.step()
    sched.step()  # LambdaLR recomputes from base_lrs: the back-off survives
    assert opt.param_groups[0]["lr"] == 0.05
