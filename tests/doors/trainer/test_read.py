"""StepRead's per-fit caches: what a step reuses, and when it must not."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn

from lightning_numguard.engine.read import StepRead
from lightning_numguard.engine.record import StepRecorder


def _reader(check: list[str]) -> StepRead:
    return StepRead(check, None, StepRecorder(check, ["*"], []))


def _setup() -> tuple[StepRead, nn.Module, torch.optim.Optimizer, SimpleNamespace]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    inspector = _reader(["grads", "optimizer_state"])
    inspector.param_names = {id(p): n for n, p in model.named_parameters()}
    return inspector, model, opt, SimpleNamespace(optimizers=[opt])


def test_the_named_optimizer_state_is_reused_while_its_tensors_are_the_same():
    inspector, _, opt, trainer = _setup()
    first = inspector.optimizer_state(trainer)
    assert [n for n, _ in first][:3] == [
        "optimizer[0].state[0.weight].step",
        "optimizer[0].state[0.weight].exp_avg",
        "optimizer[0].state[0.weight].exp_avg_sq",
    ]
    assert inspector.optimizer_state(trainer) is first  # no names rebuilt on a step that changed nothing


def test_a_replaced_optimizer_state_is_seen_at_once():
    # a restore (load_state_dict) or a new step's lazy state replaces the tensors: the check must follow them
    inspector, _, opt, trainer = _setup()
    first = inspector.optimizer_state(trainer)
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["exp_avg"].fill_(float("nan"))
    opt.load_state_dict(state)
    again = inspector.optimizer_state(trainer)
    assert again is not first
    live = opt.state[next(iter(opt.state))]["exp_avg"]
    assert any(t is live for _, t in again)
    assert all(any(t is v for _, t in again) for s in opt.state.values() for v in s.values())


def test_gradients_missing_or_sparse_are_left_out_and_the_rest_still_checked():
    emb = nn.Embedding(10, 3, sparse=True)
    used, unused = nn.Linear(3, 1), nn.Linear(3, 1)
    params = [*emb.parameters(), *used.parameters(), *unused.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    used(emb(torch.tensor([1, 2]))).sum().backward()
    inspector = _reader(["grads"])
    inspector.param_names = {id(emb.weight): "emb.weight", id(used.weight): "used.weight", id(used.bias): "used.bias"}
    named = inspector.grads(opt)
    assert [n for n, _ in named] == ["used.weight", "used.bias"]  # the sparse and the missing ones left out
    assert not inspector.plan_applies  # the per-fit plan does not apply to this step's tensors
    used.weight.grad[0, 0] = float("nan")
    total = inspector.norm_total({"grads": named}, torch.device("cpu"), torch.zeros(()))
    assert not torch.isfinite(total)
    # every gradient present: the plan applies, and a NaN is still seen
    emb.weight.grad = None
    emb.sparse = False
    opt.zero_grad(set_to_none=True)
    used(emb(torch.tensor([1, 2]))).sum().backward()
    unused(torch.ones(3)).sum().backward()
    named = inspector.grads(opt)
    assert len(named) == 5 and inspector.plan_applies
    assert torch.isfinite(inspector.norm_total({"grads": named}, torch.device("cpu"), torch.zeros(())))
    unused.bias.grad.fill_(float("inf"))
    assert not torch.isfinite(inspector.norm_total({"grads": named}, torch.device("cpu"), torch.zeros(())))


def test_state_goes_through_the_rewriting_check_only_while_no_snapshot_copies_it(tmp_path):
    """On the CPU the fused check writes the same bits back: every check reads (and rewrites) the state unchanged,
    finds a NaN weight, and is not used while an asynchronous snapshot may be copying the state on a thread."""
    from instruments.op_count import OpCounter
    from lightning_numguard import NumGuardCallback
    from tests.helpers import FaultData, FaultModel, loader, trainer

    every = ["inputs", "loss", "grads", "buffers", "params", "optimizer_state"]
    fused = {}  # whether the state went through the fused (rewriting) check, seen at the dispatcher
    for asynchronous in (False, True):
        guard = NumGuardCallback(
            dirpath=str(tmp_path / str(asynchronous)), check=every, snapshot={"asynchronous": asynchronous}
        )
        counter = OpCounter()
        counter.on = True
        torch.manual_seed(0)
        with counter:  # the spike statistics' norm takes the gradients: the fused check is the state's alone
            trainer(tmp_path / str(asynchronous), [guard], max_steps=3).fit(FaultModel(), loader(FaultData()))
        fused[asynchronous] = counter.by_op["_amp_foreach_non_finite_check_and_unscale_"] > 0
        assert counter.by_op["linalg_vector_norm"] + counter.by_op["_foreach_norm"] > 0  # control: it saw the checks
    assert fused == {False: True, True: False}

    inspector = StepRead(every, None, StepRecorder(every, [], []))
    inspector.allow_rewrite(True)
    weight = nn.Parameter(torch.tensor([[1.0, -0.0, 1e-40]]))
    bits = weight.detach().clone().view(torch.int32)
    named = [("w", weight)]
    zero = torch.zeros(())
    assert torch.isfinite(inspector.norm_total({"params": named}, torch.device("cpu"), zero))
    assert torch.equal(weight.detach().view(torch.int32), bits) and weight._version == 0
    with torch.no_grad():
        weight[0, 1] = float("nan")
    assert not torch.isfinite(inspector.norm_total({"params": named}, torch.device("cpu"), zero))
