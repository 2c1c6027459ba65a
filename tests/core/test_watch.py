import copy
import math

import torch
from torch import nn

from lightning_numguard.core.syncs import SyncCounter
from lightning_numguard.core.watch import OutputWatch, select_modules


class Bad(nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return x * float("nan") if self.armed else x + 1


def net():
    return nn.Sequential(nn.Linear(2, 2), Bad(), nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))


def test_select_modules_patterns():
    m = net()
    assert [n for n, _ in select_modules(m)] == ["0", "1", "2", "3", "3.0", "3.1"]
    assert [n for n, _ in select_modules(m, ["3*"], ["3.0"])] == ["3", "3.1"]


def test_first_bad_module_in_execution_order():
    m = net()
    w = OutputWatch(m)
    w.attach()
    m(torch.randn(3, 2))
    assert math.isfinite(w.total(torch.device("cpu")).item())
    w.reset()
    m[1].armed = True
    m(torch.randn(3, 2))
    assert not math.isfinite(w.total(torch.device("cpu")).item())
    bad = w.first_bad()
    assert [name for name, _, _ in bad] == ["1", "2", "3.0", "3.1"]  # "3" is the same tensor as "3.1"
    w.detach()
    assert all(not mod._forward_hooks for mod in m.modules())


def test_hooks_record_without_syncing():
    m = net()
    w = OutputWatch(m)
    w.attach()
    with SyncCounter(copies_from_cpu=True) as counter, counter.step():
        m(torch.randn(3, 2))
        total = w.total(torch.device("cpu"))
    assert counter.total == 0, counter.sites  # no sync in a forward hook
    assert math.isfinite(total.item())
    assert len(w.records) == 5


def test_deepcopy_of_the_model_does_not_record():
    m = net()
    w = OutputWatch(m)
    w.attach()
    ema = copy.deepcopy(m)
    ema(torch.randn(3, 2))
    assert w.records == []
    m(torch.randn(3, 2))
    assert len(w.records) == 5


def test_attach_is_idempotent():
    m = net()
    w = OutputWatch(m)
    w.attach()
    w.attach()
    m(torch.randn(1, 2))
    assert len(w.records) == 5


def test_no_records_under_no_grad():
    m = net()
    w = OutputWatch(m)
    w.attach()
    with torch.no_grad():
        m(torch.randn(1, 2))
    assert w.records == []
