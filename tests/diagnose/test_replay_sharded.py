"""The replay under collective passes: every rank runs the same passes.

Real multi-rank replays (FSDP2, tensor parallel, 2-D) run in tests/doors/trainer/test_sharded_lib.py, which also shows
that FSDP2's uninitialised all-gather buffers and tensor parallelism's all-reduce (another rank's NaN) name no op.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_numguard.diagnose.replay import replay
from tests.diagnose.test_replay import SqrtNorm, ZeroStdNorm


def _counting(model: nn.Module, x: torch.Tensor, calls: list[int]):
    def run_step() -> torch.Tensor:
        calls.append(1)
        return model(x).sum()

    return run_step


def test_agree_runs_the_backward_pass_on_a_rank_that_did_not_want_it_and_ignores_what_it_found():
    """A rank whose forward pass named its culprit would skip the backward search that another rank runs: under
    FSDP2 the other rank would then wait in a reduce-scatter for ever. ``agree`` makes every rank run it."""
    model = nn.Sequential(nn.Linear(4, 4), ZeroStdNorm(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)
    x = torch.randn(3, 4)
    wishes: list[bool] = []
    alone: list[int] = []
    assert replay(model, _counting(model, x, alone)).op == "div" and len(alone) == 1  # no second pass alone
    together: list[int] = []

    def another_rank_wants_it(wish: bool) -> bool:
        wishes.append(wish)
        return True

    result = replay(model, _counting(model, x, together), agree=another_rank_wants_it)
    assert wishes == [False] and len(together) == 2  # ran the backward search too
    assert result.stage == "forward" and result.op == "div"  # and kept its own finding


def test_agree_is_asked_with_this_ranks_wish_for_a_backward_culprit():
    model = nn.Sequential(nn.Linear(4, 4), SqrtNorm())
    x = torch.randn(3, 4)
    wishes: list[bool] = []
    result = replay(model, lambda: model(x).sum(), agree=lambda w: wishes.append(w) or w)
    assert wishes == [True] and result.stage == "backward" and result.op == "SqrtBackward0"
    vetoed = replay(model, lambda: model(x).sum(), agree=lambda w: False)  # no rank may run it alone
    assert "stage" not in vetoed.details()
