"""The defaults' kernel budget, as a count (``benchmarks/op_count.py``): it does not move with the machine's load.

At most ``BUDGET`` kernel-launching ops per step on both benchmark models, of which ``SPIKE_BUDGET`` are the spike
statistics' share (their own test keeps them there); everything else the guard runs must fit in the rest. Counted
with the op guard checking each guarded call first, as on an accelerator (on the CPU it checks fewer: the larger
count is the budget's).
"""

from __future__ import annotations

import pytest

from benchmarks.op_count import BUDGET, FIRST, SPIKE_BUDGET, count_ops

LAST = FIRST + 5  # steps 10-14: the count per step is the same as over 10-29 (docs/performance.md), in a third of it


@pytest.mark.parametrize("model", ["mlp", "lm"])
def test_the_defaults_add_at_most_the_budget_of_kernel_ops_per_step(model):
    plain = count_ops(model, None, last=LAST)
    guarded = count_ops(model, {}, check_first=True, last=LAST)
    steps = LAST - FIRST
    added = sum(guarded.by_check.values())
    assert plain.total > 0 and added > 0, "the counter saw no step"
    assert guarded.total - plain.total == added, "an op the guard caused was not attributed to a check"
    outside_spikes = added - guarded.by_check["spikes"]
    assert outside_spikes <= (BUDGET - SPIKE_BUDGET) * steps, dict(guarded.by_check)
    for check in ("outputs", "gradients + state (norm total)", "op domains", "packing + read"):
        assert guarded.by_check[check] > 0, check  # each counted where it is
