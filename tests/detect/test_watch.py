import copy
import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from instruments.syncs import SyncCounter
from lightning_numguard.detect.watch import OutputWatch, select_modules


class OpCounter(TorchDispatchMode):
    """The aten ops that reach the dispatcher while on, by name (views and ``detach`` left out)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in ("detach", "empty", "alias"):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


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
    assert [name for name, _ in bad] == ["1", "2", "3.0", "3.1"]  # "3" is the same tensor as "3.1"
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
    assert [name for name, _ in w.first_bad()] == ["0", "3", "4"]


def test_a_deep_watch_records_without_syncing_in_kernels_that_do_not_grow_with_the_blocks_and_names_the_block():
    m = Deep(n=200)
    w = OutputWatch(m, depth=1, max_per_list=None)  # every block of the list (the default caps it)
    w.attach()
    m(torch.randn(3, 2))
    assert len(w.records) == 202
    w.reset()
    m.trunk.layers[7].act[1].armed = True
    counter = OpCounter()
    with SyncCounter(copies_from_cpu=True) as syncs, syncs.step():
        out = m(torch.randn(3, 2))
        with counter:
            total = w.total(torch.device("cpu"))
    assert syncs.total == 0, syncs.sites
    # the 202 outputs: one _foreach_norm, one stack, one amax (a per-block aminmax was 202 kernels)
    assert counter.ops == ["_foreach_norm", "stack", "amax"], counter.ops
    assert not math.isfinite(total.item()) and out.isnan().all()
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
    assert [n for n, _ in w.first_bad()] == ["1", "0"]


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
        assert rows[1].tolist() == [out.abs().max().item()]
        w.reset()
        m[1].n = n  # a NaN in the block's output: its max-|x| is NaN, the block named
        m[0].bias.data.fill_(float("nan"))
        m(x)
        assert [name for name, _ in w.first_bad()] == ["0", "1"]
        assert math.isnan(w.first_bad()[1][1])


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
    assert rows[1].tolist() == [0.0] and rows[0].isfinite().all()
    w.reset()
    m.use_b = True
    m.b.bias.data.fill_(1.0)
    out = m(torch.ones(1, 2))  # step 3: it runs again, finite, and its row is written again
    (rows,) = [r for _, r in w.ranges()]
    assert rows[1].tolist() == [out.abs().max().item()]


class Shuffled(nn.Module):
    """Defined head first, run stem -> shared -> bad -> shared -> head: execution order is not definition order, and
    ``shared`` is called twice."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2, 1)
        self.shared = nn.Linear(2, 2)
        self.bad = Bad()
        self.stem = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.shared(self.bad(self.shared(self.stem(x)))))


def _records(w):
    return [(w.names[slot], w.record_tensors(i, i + 1)[0].item()) for i, (slot, _) in enumerate(w.records)]


def test_a_compiled_region_records_what_eager_records_in_execution_order_and_compiles_once():
    import torch._dynamo

    eager_model, x = Shuffled(), torch.randn(3, 2)
    compiled_model = copy.deepcopy(eager_model)
    seen = {}
    for name, model in (("eager", eager_model), ("compiled", compiled_model)):
        w = OutputWatch(model, depth=1)
        w.attach()
        run = model if name == "eager" else torch.compile(model, backend="eager")  # dynamo, no inductor: fast
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for _ in range(4):
            model.bad.armed = False
            run(x)
            clean = math.isfinite(w.total(torch.device("cpu")).item())
            seen[name] = _records(w)
            w.reset()
        assert clean
        if name == "compiled":
            counters = torch._dynamo.utils.counters
            assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # 4 steps, one graph
            assert not counters["graph_break"] and not counters["unimplemented"], dict(counters)
        w.detach()
    # the same calls, values and order: stem, shared (1st call), bad, shared (2nd call), head
    assert [n for n, _ in seen["eager"]] == ["stem", "shared", "bad", "shared", "head"]
    assert seen["compiled"] == seen["eager"]


def test_first_bad_in_a_compiled_region_is_the_first_in_execution_order_across_eager_code():
    import torch._dynamo

    torch._dynamo.reset()
    model = Shuffled()
    model.shared = torch.compile(model.shared, backend="eager")  # eager stem and head around a compiled module
    w = OutputWatch(model, depth=None)
    w.attach()
    assert "shared._orig_mod" in w.names
    model.bad.armed = True
    model(torch.randn(3, 2))
    assert not math.isfinite(w.total(torch.device("cpu")).item())
    # the compiled module's first call was clean, its second was not: it comes after `bad`, before `head`
    bad = [n for n, _ in w.first_bad()]
    assert bad[0] == "bad" and bad.index("shared._orig_mod") < bad.index("head"), bad
    kept = w.keep()
    w.reset()
    assert [n for n, _ in w.first_bad(kept)] == bad  # a step later (sync_mode="deferred")


def test_activation_checkpointing_records_the_forward_once_and_keeps_a_compiled_model_compiled():
    import torch._dynamo
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.head = nn.Linear(2, 1)

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return self.head(x)

    model = Checkpointed()
    w = OutputWatch(model, depth=1)
    w.attach()
    model(torch.randn(3, 2, requires_grad=True)).sum().backward()  # the backward recomputes every block
    assert [w.names[s] for s, _ in w.records] == ["blocks.0", "blocks.1", "blocks.2", "head"]  # not twice
    w.reset()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="eager")
    for _ in range(2):
        compiled(torch.randn(3, 2)).sum().backward()
        # inside checkpoint's body a hook writes nothing (dynamo would run the whole frame eagerly): the head records
        assert [w.names[s] for s, _ in w.records] == ["head"]
        w.reset()
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and counters["frames"]["ok"] == counters["frames"]["total"]
    assert not counters["graph_break"] and not counters["unimplemented"], dict(counters)


def test_outputs_of_every_float_dtype_keep_their_exact_max_abs():
    class Cast(nn.Module):
        def __init__(self, dtype, value):
            super().__init__()
            self.dtype, self.value = dtype, value

        def forward(self, x):
            return torch.full((4,), self.value, dtype=self.dtype) * x.sum().to(self.dtype).sign()

    m = nn.Sequential(
        nn.Linear(2, 1), Cast(torch.float16, -60000.0), Cast(torch.bfloat16, 3.0), Cast(torch.float64, 1e100)
    )
    w = OutputWatch(m, depth=1)
    w.attach()
    with torch.no_grad():
        m[0].bias.fill_(5.0)
        m[0].weight.zero_()
    with torch.enable_grad():
        m(torch.ones(1, 2))
    total = w.total(torch.device("cpu"))
    assert math.isfinite(total.item()) and total.dtype == torch.float32  # float64's 1e100 is finite, not inf
    assert [v for _, v in _records(w)] == [5.0, 60000.0, 3.0, torch.finfo(torch.float32).max]
    assert {key[1] for key, _ in w.ranges()} == {torch.float32, torch.float16, torch.bfloat16, torch.float64}
