"""DTensor local shards: checks, snapshots and restores read and write only what this rank holds.

One process: a 1-rank gloo process group (FileStore under tmp_path, destroyed after each test) and a 1-device
CPU mesh. Sharded layouts across ranks are run for real in tests/doors/trainer/test_sharded_lib.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_numguard.detect import checks
from lightning_numguard.dtensor import ShardSpec, globalize, has_dtensor, is_dtensor, local, localize
from lightning_numguard.state.snapshot import capture, restore
from lightning_numguard.tree import nbytes

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


@pytest.fixture
def mesh(tmp_path):
    """A 1-device CPU mesh; its 1-rank gloo group is created here and destroyed after the test, unless one is
    already there (a one-process ``ModelParallelStrategy`` fit earlier in this process leaves Lightning's)."""
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if owned:
            dist.destroy_process_group()


def _dt(mesh, t: torch.Tensor, placement: str = "shard"):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return distribute_tensor(t, mesh, [Shard(0) if placement == "shard" else Replicate()])


@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_local_is_the_shard_itself_and_writes_reach_the_dtensor(mesh, placement):
    d = _dt(mesh, torch.arange(6.0).reshape(3, 2), placement)
    assert is_dtensor(d) and has_dtensor([torch.zeros(1), d]) and not is_dtensor(torch.zeros(1))
    shard = local(d)
    assert not is_dtensor(shard) and shard.data_ptr() == d.to_local().data_ptr()
    shard[0, 0] = float("nan")
    assert torch.isnan(d.full_tensor()[0, 0])
    plain = torch.ones(2)
    assert local(plain) is plain


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_checks_read_the_local_shard_without_tolist_on_a_dtensor(mesh, bad):
    """Before: confirm_nonfinite raised ``.tolist() is not supported for tensor subclasses, got DTensor``."""
    big = torch.randn(1 << 16)  # a CPU tensor large enough for its own sum in TotalPlan
    small = torch.randn(4, 3)
    if bad is not None:
        small[1, 2] = bad
    tensors = [_dt(mesh, big), _dt(mesh, small), _dt(mesh, torch.randn(5), "replicate")]
    expected = [False, bad is not None, False]
    assert checks.confirm_nonfinite(tensors) == expected
    total = checks.norm_total(tensors, torch.device("cpu"))
    assert not is_dtensor(total) and bool(torch.isfinite(total)) == (bad is None)
    for rewritable in (False, True):
        plan = checks.TotalPlan(tensors)
        assert bool(torch.isfinite(plan.total(tensors, torch.device("cpu"), rewritable=rewritable))) == (bad is None)
    assert bool(torch.isfinite(checks.max_abs_total(tensors, torch.device("cpu")))) == (bad is None)
    assert [not torch.isfinite(x) for x in checks.max_abs(tensors)] == expected
    stats = checks.tensor_stats(tensors[1])
    assert stats["global_shape"] == [4, 3] and stats["nan"] + stats["posinf"] + stats["neginf"] == int(bad is not None)


def test_localize_and_globalize_round_trip_without_copies(mesh):
    d = _dt(mesh, torch.randn(4, 2))
    tree = {"w": d, "opt": [{"step": torch.tensor(3.0), "m": d}], "name": "x"}
    flat, specs = localize(tree)
    assert flat["w"] is local(d) and flat["opt"][0]["step"] is tree["opt"][0]["step"] and flat["name"] == "x"
    assert specs["w"] == ShardSpec.of(d) and specs["opt"][0]["step"] is None
    back = globalize(flat, specs)
    assert is_dtensor(back["w"]) and back["w"].placements == d.placements and back["w"].shape == d.shape
    assert local(back["w"]).data_ptr() == local(d).data_ptr()  # wrapped, not copied
    assert localize({"a": torch.zeros(1)})[1] is None and globalize(flat, None) is flat


def _sharded_model(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(6, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [local(v).clone() for v in model.state_dict().values()]
    for state in opt.state.values():
        tensors += [local(v).clone() for v in state.values()]
    return tensors


def test_a_snapshot_holds_local_shards_and_restores_them_in_place_bitwise(mesh):
    model, opt = _sharded_model(mesh)
    _step(model, opt)
    params = list(model.parameters())
    storages = [local(p).data_ptr() for p in params]
    placements = [p.placements for p in params if is_dtensor(p)]
    snap = capture(model, [opt], step=1)
    assert not any(is_dtensor(t) for t in snap.model.values())  # plain copies of the shards
    assert snap.specs["model"]["0.weight"] == ShardSpec.of(model[0].weight)
    assert snap.nbytes >= nbytes([local(p) for p in params])
    before = _state(model, opt)
    _step(model, opt)
    with torch.no_grad():
        local(model[0].weight).fill_(float("nan"))
    for state in opt.state.values():
        local(state["exp_avg_sq"]).fill_(float("nan"))
    for _ in range(2):  # twice: each restore loads a fresh clone of the optimizer state
        restore(snap, model, [opt])
        after = _state(model, opt)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        assert list(model.parameters()) == params  # the optimizer still points at the same parameters
        assert [local(p).data_ptr() for p in params] == storages  # copied into the same storage
        assert [p.placements for p in params if is_dtensor(p)] == placements
        assert all(is_dtensor(s["exp_avg"]) for s in opt.state.values() if s["exp_avg"].dim())
        _step(model, opt)  # it trains on from there
    assert all(torch.isfinite(local(p)).all() for p in params)


class _DTensorOut(nn.Module):
    """Returns its input as a replicated DTensor (tensor parallelism with ``use_local_output=False``)."""

    def __init__(self, mesh, poison: bool) -> None:
        super().__init__()
        self.mesh, self.poison = mesh, poison

    def forward(self, x: torch.Tensor):
        from torch.distributed.tensor import DTensor, Replicate

        out = DTensor.from_local(x * 2, self.mesh, [Replicate()])
        return out * float("nan") if self.poison else out


@pytest.mark.parametrize("poison", [False, True])
def test_the_output_watch_records_a_dtensor_output_by_its_local_tensor(mesh, poison):
    from lightning_numguard.detect.watch import OutputWatch

    model = nn.Sequential(nn.Linear(3, 3), _DTensorOut(mesh, poison))
    watch = OutputWatch(model, depth=None)
    watch.attach()
    try:
        model(torch.randn(2, 3))
        total = watch.total(torch.device("cpu"))
        assert not is_dtensor(total) and bool(torch.isfinite(total)) == (not poison)
        assert [name for name, _ in watch.first_bad()] == (["1"] if poison else [])
    finally:
        watch.detach()
