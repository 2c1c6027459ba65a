import copy
import pickle
import random

import pytest
import torch
from torch import nn

from lightning_numguard.state.snapshot import capture, clone_tree, restore


def setup():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    return m, opt, sched


def train(m, opt, sched, n=3):
    for _ in range(n):
        loss = m(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def assert_state_equal(a, b):
    ta, tb = tensors_of(a), tensors_of(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        assert torch.equal(x, y)


@pytest.mark.parametrize("where", ["host", "device"])
def test_restore_is_bitwise_and_in_place(where):
    m, opt, sched = setup()
    train(m, opt, sched)
    params_before = [id(p) for p in m.parameters()]
    model_sd = copy.deepcopy(m.state_dict())
    opt_sd = copy.deepcopy(opt.state_dict())
    sched_sd = copy.deepcopy(sched.state_dict())
    snap = capture(m, [opt], {"sched": sched}, step=3, where=where)
    torch_rng = torch.get_rng_state()
    py_rng = random.getstate()
    random.seed(123)  # move Python's generator away from the captured state
    train(m, opt, sched)  # diverge
    with torch.no_grad():
        m[0].weight.fill_(float("nan"))
    restore(snap, m, [opt], {"sched": sched})
    assert [id(p) for p in m.parameters()] == params_before
    assert_state_equal(m.state_dict(), model_sd)
    assert_state_equal(opt.state_dict(), opt_sd)
    assert sched.state_dict() == sched_sd
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert random.getstate() == py_rng


def test_restoring_twice_does_not_alias_the_snapshot():
    m, opt, sched = setup()
    train(m, opt, sched)
    snap = capture(m, [opt], step=1)
    restore(snap, m, [opt])
    train(m, opt, sched, 1)  # moves live state; must not move the snapshot
    restore(snap, m, [opt])
    expected = capture(m, [opt], step=1)
    assert_state_equal(snap.optimizers, expected.optimizers)
    for live in opt.state.values():
        for value in live.values():
            for kept in tensors_of(snap.optimizers):
                assert value.data_ptr() != kept.data_ptr()


def test_capture_clones_and_reuses_storage():
    m, opt, sched = setup()
    train(m, opt, sched)
    first = capture(m, [opt], step=1)
    ptrs = [t.data_ptr() for t in tensors_of(first.model)]
    assert all(t.data_ptr() != p.data_ptr() for t, p in zip(tensors_of(first.model), m.state_dict().values()))
    train(m, opt, sched, 1)
    second = capture(m, [opt], step=2, reuse=first)
    assert [t.data_ptr() for t in tensors_of(second.model)] == ptrs
    assert_state_equal(second.model, m.state_dict())


def test_nbytes_counts_model_and_optimizer_state():
    m, opt, sched = setup()
    train(m, opt, sched)
    snap = capture(m, [opt], step=1)
    param_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    # weights + buffers + AdamW's two moments (+ step counters)
    assert snap.nbytes >= 3 * param_bytes
    assert snap.nbytes < 4 * param_bytes + 4096


def test_snapshot_pickles():
    m, opt, sched = setup()
    train(m, opt, sched)
    snap = capture(m, [opt], {"sched": sched}, step=1)
    again = pickle.loads(pickle.dumps(snap))
    assert_state_equal(again.model, snap.model)


def test_restore_rejects_a_different_number_of_optimizers():
    m, opt, _ = setup()
    snap = capture(m, [opt], step=0)
    with pytest.raises(ValueError, match="1 optimizer states but 2 optimizers"):
        restore(snap, m, [opt, opt])


def test_clone_tree_keeps_namedtuples_and_non_tensors():
    from collections import namedtuple

    P = namedtuple("P", "a b")
    src = {"p": P(torch.ones(1), "x"), "l": [1, 2.0, None]}
    out = clone_tree(src)
    assert isinstance(out["p"], P) and out["p"].b == "x" and out["l"] == [1, 2.0, None]
    assert out["p"].a.data_ptr() != src["p"].a.data_ptr()
