"""The defaults' kernel budget, as a count (``benchmarks/op_count.py``): it does not move with the machine's load.

At most ``BUDGET`` kernel-launching ops per step on both benchmark models, spike statistics included, of which at
most ``SPIKE_BUDGET`` are the spike statistics' share; and on the deep residual MLP of 96 watched blocks too, so the
count does not grow with the number of blocks. Counted with the op guard checking each guarded call first,
as on an accelerator (on the CPU it checks fewer: the larger count is the budget's), over the steps of the table in
``docs/performance.md`` (10-29: a window that holds a refresh of the spike statistics and two looks at the overflow
headroom, so their occasional ops are in the count; one process takes the headroom on the host, with no op).
"""

from __future__ import annotations

import pytest

from instruments.op_count import BUDGET, FIRST, LAST, SPIKE_BUDGET, count_ops


@pytest.mark.parametrize("model", ["mlp", "lm", "deep"])
def test_the_defaults_add_at_most_the_budget_of_kernel_ops_per_step(model):
    plain = count_ops(model, None, last=LAST)
    guarded = count_ops(model, {}, check_first=True, last=LAST)
    steps = LAST - FIRST
    added = sum(guarded.by_check.values())
    assert plain.total > 0 and added > 0, "the counter saw no step"
    assert guarded.total - plain.total == added, "an op the guard caused was not attributed to a check"
    spikes = guarded.by_check["spikes"]
    assert spikes > 0, "the spike statistics were not counted"
    assert spikes <= SPIKE_BUDGET * steps, dict(guarded.by_check)
    assert added <= BUDGET * steps, dict(guarded.by_check)
    for check in ("outputs", "gradients + state (norm total)", "op domains", "packing + read"):
        assert guarded.by_check[check] > 0, check  # each counted where it is
