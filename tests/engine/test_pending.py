"""Zero-sync pieces: the flag read one step late, the device-side skip, a rollback decided one step late."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from instruments.syncs import SyncCounter
from lightning_numguard.detect import checks
from lightning_numguard.engine.pending import (
    LateSnapshots,
    PendingFlags,
    arm_device_skip,
    disarm_device_skip,
    supports_device_skip,
)
from lightning_numguard.state.snapshot import capture, restore

BAD = 3


def setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]
    x, _ = batches[BAD]
    x[0, 0] = float("nan")
    return model, opt, batches


def forward_backward(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """One step's forward and backward; returns the step's flag (0-d, on the device, no read)."""
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return (~torch.isfinite(checks.norm_total(grads, loss.device) + loss.detach())).float()


def state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()] + [
        v.clone() for s in opt.state.values() for v in s.values()
    ]


def test_pending_flags_come_back_one_step_late_without_a_read():
    pending = PendingFlags()
    with SyncCounter(copies_from_cpu=True) as counter:
        for step in range(4):
            with counter.step():
                out = pending.push(torch.tensor([float(step), 0.0, 1.5]), step)
            assert out == (None if step == 0 else (step - 1, [float(step - 1), 0.0, 1.5]))
    assert counter.step_total == [0, 0, 0, 0], counter.sites
    assert pending.pop() == (3, [3.0, 0.0, 1.5])
    assert pending.pop() is None


def test_device_skip_leaves_weights_and_adamw_state_bitwise_unchanged():
    model, opt, batches = setup()
    assert supports_device_skip(opt)
    forward_backward(model, opt, batches[0])
    opt.step()
    before = state(model, opt)
    bad = forward_backward(model, opt, batches[BAD])
    arm_device_skip(opt, bad)
    opt.step()
    disarm_device_skip(opt)
    after = state(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not hasattr(opt, "found_inf")
    forward_backward(model, opt, batches[1])  # a clean step moves the weights again
    arm_device_skip(opt, torch.zeros(()))
    opt.step()
    assert not torch.equal(state(model, opt)[0], before[0])


def test_device_skip_refuses_an_optimizer_that_ignores_found_inf():
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="fused=True"):
        arm_device_skip(torch.optim.AdamW(model.parameters(), foreach=False), torch.ones(()))


def test_zero_sync_loop_reads_nothing_and_a_late_rollback_ends_where_an_immediate_one_does():
    # immediate: read each step's flag at once; on a hit restore the snapshot of the step before
    model, opt, batches = setup()
    snap = capture(model, [opt], step=0)
    for i, batch in enumerate(batches):
        bad = forward_backward(model, opt, batch)
        if bad.item():
            restore(snap, model, [opt])
            continue
        opt.step()
        snap = capture(model, [opt], step=i + 1)
    immediate = state(model, opt)

    # one step late: no read on the step; a skip on the device; the rollback decided at the next step
    model, opt, batches = setup()
    pending, snaps = PendingFlags(), LateSnapshots[object]()
    snaps.add(0, capture(model, [opt], step=0))
    snaps.verified(0)
    i = 0
    with SyncCounter() as counter:
        while i < len(batches):
            with counter.step():
                bad = forward_backward(model, opt, batches[i])
                arm_device_skip(opt, bad)
                opt.step()
                disarm_device_skip(opt)
                late = pending.push(bad.reshape(1), i + 1)
                snaps.add(i + 1, capture(model, [opt], step=i + 1))
            if late is not None:
                step, (flag,) = late
                if flag:  # step `step` was bad: back to the last verified state, redo the batches after it
                    snaps.discard_from(step)
                    snaps.restore(lambda s: restore(s, model, [opt]))  # type: ignore[arg-type]
                    pending = PendingFlags()
                    i = step  # batches[step - 1] was the bad one: carry on with the next
                    continue
                snaps.verified(step)
            i += 1
    assert set(counter.step_total) == {0}, counter.sites
    late_state = state(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(immediate, late_state))
