"""Asynchronous batches of tensor copies (core.async_copy) and the split capture (core.snapshot)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lightning_numguard.state import async_copy
from lightning_numguard.state.snapshot import capture, finish_capture, restore, start_capture


def _pairs(n: int = 5) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(64, 33, generator=g) for _ in range(n)] + [torch.tensor([float("nan"), -0.0, float("inf")])]
    return [torch.empty_like(s) for s in src], src


@pytest.mark.parametrize("backend", ["thread", "sync"])
def test_copies_land_bitwise_and_wait_is_idempotent(backend):
    dst, src = _pairs()
    handle = async_copy.start(dst, src, backend)
    handle.wait()
    handle.wait()
    handle.synchronize()
    for d, s in zip(dst, src):
        assert torch.equal(d.view(torch.int32), s.view(torch.int32))  # bitwise: NaN and -0.0 included


def test_the_thread_backend_runs_off_the_callers_thread():
    seen: list[str] = []
    release = threading.Event()
    original = async_copy._copy_all

    def held(d, s):  # the worker copies only once the caller releases it
        seen.append(threading.current_thread().name)
        assert release.wait(10)
        original(d, s)

    src = [torch.ones(3)]
    dst = [torch.zeros(3)]
    async_copy._copy_all = held
    try:
        handle = async_copy.start(dst, src, "thread")
        assert torch.equal(dst[0], torch.zeros(3))  # start returned before the copy: the caller goes on
        release.set()
        handle.wait()
    finally:
        async_copy._copy_all = original
    assert seen == ["numguard-snapshot"]
    assert torch.equal(dst[0], src[0])


def test_an_error_in_the_worker_is_raised_by_wait_every_time():
    handle = async_copy.start([torch.empty(3)], [torch.ones(4)], "thread")  # shapes do not broadcast
    with pytest.raises(RuntimeError, match="asynchronous snapshot copy failed"):
        handle.wait()
    with pytest.raises(RuntimeError, match="asynchronous snapshot copy failed"):
        handle.synchronize()


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="pair up"):
        async_copy.start([torch.empty(1)], [], "thread")
    with pytest.raises(ValueError, match="stream"):
        async_copy.start([torch.empty(1)], [torch.ones(1)], "stream")
    with pytest.raises(ValueError, match="backend"):
        async_copy.start([torch.empty(1)], [torch.ones(1)], "gpu")  # type: ignore[arg-type]
    assert async_copy.backend_for([torch.ones(1)], asynchronous=False) == "sync"
    assert async_copy.backend_for([torch.ones(1)], asynchronous=True) == "thread"


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(6, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _equal_trees(a, b):
    from lightning_numguard.tree import tensors

    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


@pytest.mark.parametrize("shard_among", [None, (0, 1)])
def test_the_split_capture_equals_the_synchronous_one_and_reuses_the_spare(shard_among):
    model, opt = _trained()
    ref = capture(model, [opt], step=2, rng={"torch": torch.get_rng_state()}, shard_among=shard_among)
    spare = capture(model, [opt], step=1, rng={}, shard_among=shard_among)
    pending = start_capture(model, [opt], step=2, reuse=spare, shard_among=shard_among, backend="thread")
    got = finish_capture(pending, model, [opt], rng={"torch": torch.get_rng_state()})
    pending.wait()
    assert got.ready().copies is None and got.step == 2
    if shard_among is None:
        assert got.model["0.weight"] is spare.model["0.weight"]  # the spare's storage, not a new allocation
        assert list(got.model) == list(ref.model)
    else:
        assert got.sharded is not None and ref.sharded is not None
        assert all(got.sharded.local[d] is spare.sharded.local[d] for d in got.sharded.local)
        assert _equal_trees(list(got.sharded.local.values()), list(ref.sharded.local.values()))
    assert _equal_trees(got.model, ref.model) and _equal_trees(got.optimizers, ref.optimizers)
    assert [o["param_groups"] for o in got.optimizers] == [o["param_groups"] for o in ref.optimizers]


def test_a_pending_snapshot_restores_bitwise_after_the_live_state_moved_on():
    model, opt = _trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pending = start_capture(model, [opt], step=2, backend="thread")
    snap = finish_capture(pending, model, [opt])
    pending.wait()
    model(torch.randn(6, 4)).sum().backward()
    opt.step()  # the sources are overwritten only after wait()
    restore(snap, model, [opt])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stream backend needs CUDA")
def test_the_stream_backend_copies_on_a_side_stream_ordered_before_later_writes():
    src = [torch.randn(1024, 1024, device="cuda") for _ in range(4)]
    expected = [s.cpu() for s in src]
    dst = [torch.empty(s.shape, pin_memory=True) for s in src]
    handle = async_copy.start(dst, src, async_copy.backend_for(src, asynchronous=True))
    handle.wait()  # the current stream waits on the side stream: the writes below come after the copies
    for s in src:
        s.mul_(2)
    handle.synchronize()
    for d, e in zip(dst, expected):
        assert torch.equal(d, e)
