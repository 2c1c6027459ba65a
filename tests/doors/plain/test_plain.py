"""The plain-PyTorch door: ``attach(model, optimizer)`` on loops written as users write them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_numguard import NonFiniteError, NumGuardConfigError, attach
from lightning_numguard.detect.opguard import patch as opguard_patch
from tests.helpers import guard_warns

ORIGINAL_BACKWARD = torch.Tensor.backward
ORIGINAL_AUTOGRAD_BACKWARD = torch.autograd.backward


# ---------------------------------------------------------------------------------------------- the seeds' story


class MeanShift(nn.Conv2d):
    """RCAN's fixed colour normalisation: a 1x1 convolution whose weights are not to be trained."""

    def __init__(self) -> None:
        super().__init__(3, 3, kernel_size=1)
        with torch.no_grad():
            self.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
            self.bias.zero_()
        for p in self.parameters():
            p.requires_grad = False


class RCAN(nn.Module):
    """A tiny residual channel-attention network (the seeds' modelA)."""

    def __init__(self) -> None:
        super().__init__()
        self.sub_mean = MeanShift()
        self.head = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.attention = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 8, 1), nn.Sigmoid())
        self.tail = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(self.sub_mean(x))
        r = self.body(h)
        return self.tail(h + r * self.attention(r))


class Judge(nn.Module):
    """The seeds' modelB: its last layer is a sigmoid, so its output "is always in [0, 1]"."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv(x))


def images(n: int = 6, corrupt: int | None = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [(torch.rand(2, 3, 8, 8, generator=g), torch.rand(2, 1, 8, 8, generator=g).round()) for _ in range(n)]
    if corrupt is not None:
        out[corrupt][0][1, 0, 4, 4] = float("nan")  # one corrupted pixel
    return out


def seed_loop(guarded: bool, tmp_path: Path) -> tuple[RCAN, Judge, Any]:
    """The seeds' loop, as written: ``optimizerG = optim.Adam(netG.parameters())`` (the frozen MeanShift included),
    modelB on modelA's output, ``nn.BCELoss``."""
    torch.manual_seed(0)
    net_g, net_b = RCAN(), Judge()
    optimizer_g = torch.optim.Adam(net_g.parameters(), lr=1e-3)
    optimizer_b = torch.optim.Adam(net_b.parameters(), lr=1e-3)
    criterion = nn.BCELoss()
    guard = (
        attach({"net_g": net_g, "net_b": net_b}, [optimizer_g, optimizer_b], dirpath=str(tmp_path)) if guarded else None
    )
    for x, target in images():
        out = net_b(net_g(x))
        loss = criterion(out, target)
        optimizer_g.zero_grad()
        optimizer_b.zero_grad()
        loss.backward()
        optimizer_g.step()
        optimizer_b.step()
    if guard is not None:
        guard.close()
    return net_g, net_b, guard


def test_unguarded_the_seeds_loop_dies_in_bce(tmp_path: Path) -> None:
    """Control: the same loop without the guard dies where the seeds' did (on the CPU: a RuntimeError)."""
    with pytest.raises(RuntimeError, match="all elements of input should be between 0 and 1"):
        seed_loop(False, tmp_path)


def test_the_seeds_loop_is_guarded_by_two_lines(tmp_path: Path) -> None:
    """An upstream NaN reaching ``BCELoss`` is caught and named before BCE runs, the step rolled back, the loop
    goes on; the frozen layers handed to the optimizer are said at the first step."""
    with guard_warns(r"sub_mean\.weight"):
        net_g, net_b, guard = seed_loop(True, tmp_path)
    kinds = [(e["kind"], e["step"], e["where"][:1], e["action"]) for e in guard.events]
    assert kinds[0] == ("optimizer_coverage", 0, ["net_g.sub_mean.weight"], "none"), kinds
    incident = [k for k in kinds if k[1] == 3]
    assert incident[0] == ("nonfinite_input", 3, ["batch['x']"], "rollback"), kinds
    assert ("op_domain", 3, ["binary_cross_entropy"], "rollback") in incident, kinds
    assert guard.counters["rollbacks"] == 1 and all(k[1] in (0, 3) for k in kinds)
    for net in (net_g, net_b):
        assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    assert (tmp_path / "events.jsonl").is_file() and (tmp_path / "last_finite.ckpt").is_file()
    assert torch.Tensor.backward is ORIGINAL_BACKWARD and torch.autograd.backward is ORIGINAL_AUTOGRAD_BACKWARD
    assert opguard_patch._installed == {}


# ---------------------------------------------------------------------------------------------- the handle


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batches(n: int = 6, bad: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]
    if bad is not None:
        out[bad][0][0, 1] = float("inf")
    return out


def train(model: nn.Module, optimizer: Any, data: list[Any], accumulate: int = 1, scheduler: Any = None) -> list[float]:
    """The loop as a user writes it; returns the learning rate after each step."""
    lrs = []
    for i, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y) / accumulate
        loss.backward()
        if (i + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_a_context_manager_guard_names_skips_and_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with attach(net, optimizer, action="skip", dirpath=str(tmp_path), emit_warnings=False) as guard:
        train(net, optimizer, batches(bad=2))
        assert not guard.closed
    assert guard.closed and "closed" in repr(guard)
    first = guard.events[0]
    assert (first["kind"], first["where"], first["step"], first["action"]) == (
        "nonfinite_input",
        ["batch['x']"],
        2,
        "skip",
    )
    assert guard.counters["skipped_steps"] == 1 and guard.counters["rollbacks"] == 0
    assert torch.Tensor.backward is ORIGINAL_BACKWARD
    guard.close()  # idempotent
    train(net, optimizer, batches(2, bad=0))  # the model and the optimizer are free again
    assert len(guard.events) == 3


def test_accumulation_is_one_step_per_optimizer_step_and_names_the_micro_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with attach(net, optimizer, dirpath=str(tmp_path), emit_warnings=False) as guard:
        train(net, optimizer, batches(8, bad=3), accumulate=2)
    first = guard.events[0]
    assert (first["kind"], first["step"], first["batch_idx"]) == ("nonfinite_input", 1, 3)
    assert {e["step"] for e in guard.events} == {1}


def test_a_rollback_keeps_the_loops_own_learning_rate(tmp_path: Path) -> None:
    """The rollback restores the weights and the optimizer state; the scheduler the loop steps keeps its place."""
    runs = []
    for bad in (None, 2):
        torch.manual_seed(0)
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
        with attach(net, optimizer, dirpath=str(tmp_path / str(bad)), emit_warnings=False) as guard:
            runs.append(train(net, optimizer, batches(bad=bad), scheduler=scheduler))
        assert guard.counters["rollbacks"] == (bad is not None)
    assert runs[0] == runs[1] == [0.1 * 0.5**k for k in range(1, 7)]


def test_a_halt_raises_out_of_step_with_the_last_finite_state_saved(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    guard = attach(net, optimizer, action="halt", dirpath=str(tmp_path), emit_warnings=False)
    with pytest.raises(NonFiniteError, match=r"halted training at step 2.*torch\.load\("):
        train(net, optimizer, batches(bad=2))
    assert guard.closed and torch.Tensor.backward is ORIGINAL_BACKWARD
    state = torch.load(tmp_path / "last_finite.ckpt", weights_only=False)
    assert set(state) == {"model", "optimizers", "numguard"}
    net.load_state_dict(state["model"])
    assert state["numguard"]["counters"]["incidents"] == 1


class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * float("nan") if self.calls == 3 else x


def test_a_transient_fault_is_retried_from_the_restored_state(tmp_path: Path) -> None:
    """``recovery.retry_transient``: the micro-batch re-run through the loop's quiet re-run (the model's forward with
    the recorded arguments) comes out finite, so the fault is transient."""
    torch.manual_seed(0)
    net = Net()
    net.body.append(Flaky())  # NaN out of its third call only
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with attach(net, optimizer, dirpath=str(tmp_path), emit_warnings=False, recovery={"retry_transient": True}) as g:
        train(net, optimizer, batches())
    event = g.events[0]
    assert (event["kind"], event["where"], event["step"]) == ("nonfinite_output", ["body.2"], 2), event
    assert event["details"]["retry"] == "transient: finite on retry"


def test_a_compiled_model_is_guarded_and_named_as_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    model = torch.compile(net, backend="eager")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with attach(model, optimizer, dirpath=str(tmp_path), emit_warnings=False) as guard:
        train(model, optimizer, batches(bad=2))
    first = guard.events[0]
    assert (first["kind"], first["where"]) == ("nonfinite_input", ["batch['x']"])
    assert any(e["kind"] == "nonfinite_output" and e["where"][0].startswith(("body", "head")) for e in guard.events)


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_input_is_named() -> None:
    net, other = Net(), Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(NumGuardConfigError, match=r"attach\(\) got 'str' where the model was expected"):
        attach("net", optimizer)
    with pytest.raises(NumGuardConfigError, match=r"attach\(\) got 'Linear' where the optimizer was expected"):
        attach(net, nn.Linear(1, 1))
    with pytest.raises(NumGuardConfigError, match=r"'1' \(int\) where models were expected"):
        attach([net, 1], optimizer)
    with pytest.raises(NumGuardConfigError, match=r"holds 4 parameter\(s\) of no guarded module"):
        attach(net, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(NumGuardConfigError, match=r"action.*'explode'"):
        attach(net, optimizer, action="explode")
    first = attach(net, optimizer, emit_warnings=False)
    with pytest.raises(NumGuardConfigError, match=r"already guarded"):
        attach(other, [optimizer, torch.optim.SGD(other.parameters(), lr=0.1)])
    with pytest.raises(NumGuardConfigError, match=r"this Net is already guarded"):
        attach(net, torch.optim.SGD(net.parameters(), lr=0.1))
    first.close()
    attach(net, optimizer).close()  # free again once closed
    assert torch.Tensor.backward is ORIGINAL_BACKWARD


def test_sharded_parameters_are_refused_at_attach(tmp_path: Path) -> None:
    """These doors guard one device and DDP: DTensor shards (FSDP2's ``fully_shard``, here on a one-process gloo group)
    are refused at attach, naming the door that guards them."""
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        net = Net()
        fully_shard(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.raises(NumGuardConfigError, match=r"attach\(\) got a model whose parameters are DTensor shards"):
            attach(net, optimizer, dirpath=str(tmp_path))
    finally:
        dist.destroy_process_group()


def _hooks(net: nn.Module, optimizer: Any) -> int:
    modules = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())
    return modules + len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)


def test_every_hook_is_removed_at_close_and_a_second_guard_does_not_stack_them(tmp_path: Path) -> None:
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    counts = []
    for _ in range(2):
        with attach(net, optimizer, dirpath=str(tmp_path), emit_warnings=False):
            counts.append(_hooks(net, optimizer))
            train(net, optimizer, batches(2))
        assert _hooks(net, optimizer) == 0
    assert counts[0] == counts[1] > 0
    with pytest.raises(RuntimeError, match="boom"), attach(net, optimizer, dirpath=str(tmp_path)):
        raise RuntimeError("boom")  # the loop's own error: the guard ends with it
    assert _hooks(net, optimizer) == 0 and torch.Tensor.backward is ORIGINAL_BACKWARD


def test_deferred_reads_skip_a_bad_step_on_the_device_one_step_late(tmp_path: Path) -> None:
    """``sync_mode="deferred"`` applies to a plain loop (it clips nothing by itself): a fused optimizer's step is
    skipped on the device, the step's flags read one step later, with no host read per step."""
    from instruments.syncs import SyncCounter

    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    args: dict[str, Any] = {"action": "skip", "sync_mode": "deferred", "emit_warnings": False}
    with attach(net, optimizer, dirpath=str(tmp_path), **args) as guard, SyncCounter(copies_from_cpu=True) as counter:
        for x, y in batches(8, bad=3):
            with counter.step():
                loss = F.mse_loss(net(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    first = guard.events[0]
    assert (first["kind"], first["step"], first["action"], first["details"]["read_at_step"]) == (
        "nonfinite_input", 3, "skip", 4,
    )  # fmt: skip
    assert guard.counters["skipped_steps"] == 1
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    clean = [n for i, n in enumerate(counter.step_caused) if i not in (0, 4)]  # fit start; the late read's findings
    assert clean == [0] * 6, dict(counter.sites)
