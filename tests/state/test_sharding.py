"""Sharded snapshots: each rank keeps 1/world of the state; a gather over 2 gloo ranks restores it bitwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_numguard.state.sharding import gather, shard, unshard
from lightning_numguard.tree import nbytes


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Linear(13, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 7)).square().mean().backward()
        opt.step()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizers": [opt.state_dict()]}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_each_rank_keeps_a_world_th_and_the_slices_rebuild_the_state_bitwise():
    state = _state(*_trained())
    full = nbytes(state)
    for world in (1, 2, 3, 8):
        parts = [shard(state, rank, world) for rank in range(world)]
        assert all(p.nbytes <= full / world + 8 * len(p.local) for p in parts), (world, [p.nbytes for p in parts])
        assert _equal(unshard(parts[0], [p.local for p in parts]), state)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, opt = _trained()  # data parallel: every rank holds the same state
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        sharded = shard(_state(model, opt), rank, world)
        with torch.no_grad():  # the run goes bad after the snapshot
            for p in model.parameters():
                p.fill_(float("nan"))
        opt.zero_grad()
        model(torch.randn(8, 7)).sum().backward()
        opt.step()
        back = gather(sharded)
        model.load_state_dict(back["model"])
        opt.load_state_dict(back["optimizers"][0])
        expected = _state(*_trained())
        ok = _equal(model.state_dict(), reference) and _equal(_state(model, opt), expected)
        torch.save({"ok": ok, "bytes": sharded.nbytes, "full": nbytes(expected)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_restore_bitwise_from_their_halves(tmp_path: Path):
    init = f"file://{tmp_path / 'store'}"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(2, init, str(tmp_path / "result")), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"result.{r}") for r in range(2)]
    assert [r["ok"] for r in results] == [True, True]
    assert all(r["bytes"] <= r["full"] / 2 + 64 for r in results), results


def test_a_sharded_capture_keeps_buffers_whole_and_rebuilds_the_full_snapshot_bitwise():
    import pytest

    from lightning_numguard.state.sharding import pack, unpack
    from lightning_numguard.state.snapshot import capture, restore, unsharded

    model, opt = _trained()
    full = capture(model, [opt], step=2)
    parts = [capture(model, [opt], step=2, shard_among=(r, 3)) for r in range(3)]
    for p in parts:  # parameters and AdamW state sharded; BatchNorm buffers (may differ per rank) kept whole
        assert p.optimizers == [] and set(p.model) == {k for k in full.model if "running" in k or "batches" in k}
        assert p.sharded is not None and p.sharded.nbytes <= (full.nbytes - nbytes(p.model)) / 3 + 64
    assert parts[1].nbytes < full.nbytes / 2
    stacked = torch.stack([pack(p.sharded) for p in parts])  # what the strategy's all_gather returns
    back = unsharded(parts[1], unpack(parts[1].sharded, stacked))
    assert list(back.model) == list(full.model)  # the state_dict's order too
    assert _equal(back.model, full.model) and _equal(back.optimizers, full.optimizers)
    with pytest.raises(ValueError, match="unsharded"):
        restore(parts[0], model, [opt])
    again = capture(model, [opt], step=3, shard_among=(1, 3), reuse=parts[1])  # storage reused, not reallocated
    assert all(again.sharded.local[d] is parts[1].sharded.local[d] for d in again.sharded.local)
