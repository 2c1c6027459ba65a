"""``torch.compile`` under the guard, counted by inductor and dynamo themselves (``benchmarks/compiled.py``).

Each graph compiles once over a whole fit (2 and 20 steps: the same graphs as without the guard, no graph break), the
guard's per-block checks ride the kernels that compute the blocks' outputs (at most 2 more inductor kernels per graph,
at 2 and at 8 blocks), a clean compiled fit ends with the same bits as one without the guard, and a NaN made inside a
compiled block is named, in both read schedules. Counts, not times: they do not move with the machine's load. Both
places a compiled region can sit are covered: a compiled function inside the LightningModule (the hooks of the blocks
inside the region, the LightningModule's own call outside) and ``trainer.fit(torch.compile(module))``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from instruments.compiled import CompiledMLP, batches, compile_counts, extra_per_graph

pytest.importorskip("torch._inductor")
pytestmark = pytest.mark.slow  # each test compiles a model twice (with and without the guard): 1-4 min under load

STEPS = 20


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["forward", "module"])
def test_a_compiled_fit_compiles_each_graph_once_with_at_most_two_more_kernels_and_the_same_bits(mode):
    plain = compile_counts(2, False, STEPS, at=(2,), mode=mode)
    guarded = compile_counts(2, True, STEPS, at=(2,), mode=mode)
    assert plain.graphs == guarded.graphs == {2: 1, STEPS: 1}  # no recompile at the second step, nor later
    assert plain.breaks == guarded.breaks == {2: 0, STEPS: 0}
    assert guarded.kernels[2] == guarded.kernels[STEPS]  # nothing generated after the first step
    assert 0 <= extra_per_graph(plain, guarded, STEPS) <= 2, (plain.kernels, guarded.kernels)
    assert _same_bits(plain.state, guarded.state)  # a clean compiled fit is bitwise the unguarded one
    assert guarded.events == []


def test_the_guards_kernels_do_not_grow_with_the_number_of_compiled_blocks():
    plain = compile_counts(8, False, 2, at=(1,))
    guarded = compile_counts(8, True, 2, at=(1,))
    assert guarded.graphs == plain.graphs == {1: 1, 2: 1}
    assert 0 <= extra_per_graph(plain, guarded, 2) <= 2, (plain.kernels, guarded.kernels)  # 10 watched outputs
    assert _same_bits(plain.state, guarded.state)


def test_dynamic_shapes_compile_once_with_the_guard_as_without():
    data = batches(6, last=5)  # the last batch is smaller: under dynamic=True the same graphs serve it
    plain = compile_counts(2, False, 6, at=(1,), dynamic=True, data=data)
    guarded = compile_counts(2, True, 6, at=(1,), dynamic=True, data=data)
    assert guarded.graphs == plain.graphs and guarded.breaks == plain.breaks == {1: 0, 6: 0}
    assert guarded.kernels[1] == guarded.kernels[6]
    assert _same_bits(plain.state, guarded.state)


class SqrtBlock(nn.Module):
    """A pre-LayerNorm block scaled by ``sqrt(gain)``: a gain below 0 makes its output NaN inside the compiled code."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x))) * torch.sqrt(self.gain)


class Faulty(CompiledMLP):
    """Its block 1's gain goes to -1 before step ``bad`` (a finite buffer: only the forward makes the NaN)."""

    def __init__(self, bad: int, mode: str) -> None:
        super().__init__(3, compile_forward=mode == "forward")
        self.bad = bad
        self.net.blocks = nn.ModuleList(SqrtBlock(self.net.inp.out_features) for _ in range(3))

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if self.trainer.global_step == self.bad:
            self.net.blocks[1].gain.fill_(-1.0)


@pytest.mark.parametrize(("mode", "sync_mode"), [("forward", "every_step"), ("module", "deferred")])
def test_a_nan_made_inside_a_compiled_block_is_named(mode, sync_mode):
    bad = 3
    counts = compile_counts(
        3,
        True,
        6,
        at=(1,),
        mode=mode,
        module=Faulty(bad, mode),
        guard_kwargs={"sync_mode": sync_mode, "emit_warnings": False},
    )
    first = counts.events[0]
    assert (first["kind"], first["step"]) == ("nonfinite_output", bad), first
    assert first["where"] == ["net.blocks.1"], first  # the compiled region's records: block 1, not a later one
    assert first["details"]["also"][0] == "net.blocks.2"  # what it reached next, in execution order
    if sync_mode == "every_step" and hasattr(torch.compiler, "set_stance"):  # the replay ran the compiled code
        assert first["op"] == "sqrt", first  # eagerly and found the op (a step read late is not replayed)
    else:
        assert first["details"].get("deferred") is (sync_mode == "deferred"), first
    assert counts.graphs[6] == counts.graphs[1] and counts.breaks[6] == 0  # the replay compiled nothing
