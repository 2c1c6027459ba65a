import copy
import math

import torch
from torch import nn

from instruments.syncs import SyncCounter
from lightning_numguard.detect.watch import OutputWatch, select_modules


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


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.act = nn.Sequential(nn.Tanh(), Bad())

    def forward(self, x):
        return self.act(self.fc(x))


class Deep(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.stem = nn.Linear(2, 2)
        self.trunk = nn.Module()
        self.trunk.layers = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(2, 1))

    def forward(self, x):
        x = self.stem(x)
        for layer in self.trunk.layers:
            x = layer(x)
        return self.head(x)


def test_block_selection_watches_blocks_not_leaves():
    m = Deep()
    names = [n for n, _ in select_modules(m, depth=1)]
    # head is a transparent Sequential (its output is head.1's); head.0 is a ReLU, a pass-through module
    assert names == ["stem", "trunk", "trunk.layers.0", "trunk.layers.1", "trunk.layers.2", "head.1"]
    assert "trunk.layers.1.fc" in [n for n, _ in select_modules(m, depth=3)]  # trunk 1, layers.1 2, fc 3
    # an explicit pattern reaches below the depth; exclusion still applies
    assert [n for n, _ in select_modules(m, ["*.act.1"], depth=1)] == [f"trunk.layers.{i}.act.1" for i in range(3)]
    assert "trunk.layers.1" not in [n for n, _ in select_modules(m, ["*"], ["trunk.layers.1"], depth=1)]


def test_only_the_outermost_sequential_of_a_nest_is_transparent():
    def stage():
        return nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1), nn.ReLU())

    net = nn.Sequential(stage(), nn.MaxPool2d(1), stage(), nn.Flatten(), nn.Linear(1, 1))
    outer = nn.Module()
    outer.net = net
    # the stages are blocks, their convolutions and norms are not (one level deeper)
    assert [n for n, _ in select_modules(outer, depth=1)] == ["net.0", "net.2", "net.4"]
    assert [n for n, _ in select_modules(outer, depth=2)] == [
        "net.0",
        "net.0.0",
        "net.0.1",
        "net.2",
        "net.2.0",
        "net.2.1",
        "net.4",
    ]
    assert [n for n, _ in select_modules(net, depth=1)] == ["0", "2", "4"]  # the Sequential as the root
    # a Sequential element of a long ModuleList is a block, sampled like any element; its insides are not
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)) for _ in range(4))
    holder = nn.Module()
    holder.blocks = blocks
    assert [n for n, _ in select_modules(holder, depth=1, max_per_list=2)] == ["blocks.1", "blocks.3"]


def test_pass_through_modules_are_not_blocks_but_what_they_pass_on_is_caught():
    class Relu2(nn.ReLU):  # a subclass may compute anything: watched like any module
        pass

    m = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Dropout(0.0), Relu2(), nn.Linear(2, 2), nn.Sigmoid())
    names = [n for n, _ in select_modules(m, depth=1)]
    assert names == ["0", "3", "4"]
    assert [n for n, _ in select_modules(m, ["*", "1"], depth=1)] == ["0", "1", "3", "4"]  # named explicitly
    assert [n for n, _ in select_modules(m, depth=None)] == [str(i) for i in range(6)]  # every module
    w = OutputWatch(m, depth=1)
    w.attach()
    with torch.no_grad():
        m[0].bias.fill_(float("nan"))
    with torch.enable_grad():
        m(torch.randn(3, 2))
    assert not math.isfinite(w.total(torch.device("cpu")).item())
    assert [name for name, _, _ in w.first_bad()] == ["0", "3", "4"]


def test_block_watch_writes_into_a_preallocated_buffer_and_names_the_block():
    m = Deep(n=200)
    w = OutputWatch(m, depth=1, max_per_list=None)  # every block of the list (the default caps it)
    w.attach()
    m(torch.randn(3, 2))
    (slots,) = w._buffers.values()
    storage = slots.values.data_ptr()
    w.reset()
    m.trunk.layers[7].act[1].armed = True
    with SyncCounter(copies_from_cpu=True) as counter, counter.step():
        m(torch.randn(3, 2))
        total = w.total(torch.device("cpu"))
    assert counter.total == 0, counter.sites
    assert slots.values.data_ptr() == storage and len(w._buffers) == 1  # the same buffer, step after step
    assert not math.isfinite(total.item())
    assert w.first_bad()[0][0] == "trunk.layers.7"


def test_a_module_called_twice_in_a_step_keeps_both_records():
    lin, bad = nn.Linear(2, 2), Bad()
    m = nn.Sequential(lin, bad, lin)
    w = OutputWatch(m)
    w.attach()
    m(torch.randn(1, 2))
    assert [s for s, _ in w.records] == [0, 1, 0]
    assert w.first_bad() == []
    w.reset()
    bad.armed = True  # the second call of `lin` (an extra record, not its buffer row) is bad too
    m(torch.randn(1, 2))
    assert [n for n, _, _ in w.first_bad()] == ["1", "0"]


def test_a_long_list_is_watched_at_every_stride_th_block_and_still_catches_a_bad_one():
    m = Deep(n=200)
    listed = [n for n, _ in select_modules(m, depth=1) if n.startswith("trunk.layers.")]
    assert listed == [f"trunk.layers.{i}" for i in range(12, 200, 13)] + ["trunk.layers.199"]  # ceil(200/16) = 13
    assert len([n for n, _ in select_modules(m, depth=1, max_per_list=None) if n.startswith("trunk.layers.")]) == 200
    assert "trunk.layers.7" in [n for n, _ in select_modules(m, ["trunk.layers.7"], depth=1)]  # named: watched
    w = OutputWatch(m, depth=1)
    w.attach()
    m.trunk.layers[7].act[1].armed = True
    m(torch.randn(3, 2))
    assert not math.isfinite(w.total(torch.device("cpu")).item())
    assert w.first_bad()[0][0] == "trunk.layers.12"  # the next watched block; the replay names the exact one


def test_a_block_range_is_exact_for_small_and_large_outputs():
    class Widen(nn.Module):  # a block whose output has n elements
        def __init__(self, n):
            super().__init__()
            self.n = n

        def forward(self, x):
            return x.sum() + torch.linspace(-3.0, 5.0, self.n)

    for n in (1000, 1 << 20):  # in a core's cache, and beyond it
        m = nn.Sequential(nn.Linear(2, 1), Widen(n))
        w = OutputWatch(m, depth=1)
        w.attach()
        x = torch.zeros(1, 2)
        out = m(x)
        (rows,) = [r for _, r in w.ranges()]
        assert rows[1].tolist() == [out.min().item(), out.max().item()]
        w.reset()
        m[1].n = n  # a NaN in the block's output: both ends NaN, the block named
        m[0].bias.data.fill_(float("nan"))
        m(x)
        assert [name for name, lo, hi in w.first_bad()] == ["0", "1"]
        assert all(math.isnan(v) for v in w.first_bad()[1][1:])


def test_a_block_that_did_not_run_in_a_step_reads_zero_not_an_earlier_steps_range():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.use_b = True

        def forward(self, x):
            h = self.a(x)
            return self.b(h) if self.use_b else h

    m = Branchy()
    w = OutputWatch(m, depth=1)
    w.attach()
    m.b.bias.data.fill_(float("nan"))
    m(torch.ones(1, 2))  # step 1: `b` runs and goes non-finite
    assert not math.isfinite(w.total(torch.device("cpu")).item())
    w.reset()
    m.use_b = False
    m(torch.ones(1, 2))  # step 2: `b` does not run: its NaN row is not this step's
    assert math.isfinite(w.total(torch.device("cpu")).item())
    (rows,) = [r for _, r in w.ranges()]
    assert rows[1].tolist() == [0.0, 0.0] and rows[0].isfinite().all()
    w.reset()
    m.use_b = True
    m.b.bias.data.fill_(1.0)
    out = m(torch.ones(1, 2))  # step 3: it runs again, finite, and its row is written again
    (rows,) = [r for _, r in w.ranges()]
    assert rows[1].tolist() == [out.min().item(), out.max().item()]
