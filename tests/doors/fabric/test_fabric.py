"""The Fabric door on a Fabric loop of the test's own: a real ``Fabric`` on the CPU, the guard as its callback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_numguard import NonFiniteError, NumGuardConfigError
from lightning_numguard.fabric import NumGuard

lightning_fabric = pytest.importorskip("lightning.fabric")
Fabric = lightning_fabric.Fabric


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batches(n: int = 6, bad: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]
    if bad is not None:
        out[bad][0][3, 2] = float("nan")
    return out


def fabric_of(guard: NumGuard | None, **kwargs: Any) -> Any:
    return Fabric(accelerator="cpu", devices=1, callbacks=[guard] if guard is not None else [], **kwargs)


def fit(
    fabric: Any,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    together: bool = True,
    nan_grad_at: int | None = None,
    skip: int | None = None,
    accumulate: int = 1,
) -> nn.Module:
    """A LitGPT-shaped loop: the LR set by hand, ``no_backward_sync``, ``fabric.backward``, ``clip_gradients`` with
    its default ``error_if_nonfinite=True``, ``step``, ``zero_grad``. ``nan_grad_at``: the gradient of
    ``body.0.weight`` is NaN in that iteration's backward pass; ``skip``: that batch is left out (the reference)."""
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    if together:
        model, optimizer = fabric.setup(net, optimizer)
    else:
        model = fabric.setup(net)
        optimizer = fabric.setup_optimizers(optimizer)
    now = {"i": -1}
    net.body[0].weight.register_hook(lambda g: g * float("nan") if now["i"] == nan_grad_at else g)
    for i, (x, y) in enumerate(data):
        if i == skip:
            continue
        now["i"] = i
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 / (1 + i)
        accumulating = (i + 1) % accumulate != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = F.mse_loss(model(x), y)
            fabric.backward(loss / accumulate)
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    return net


def weights(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("together", [True, False], ids=["setup(model, optimizer)", "setup_optimizers"])
def test_a_nan_gradient_is_dropped_before_clip_gradients_and_the_step_rolled_back(tmp_path: Path, together: bool):
    """``clip_gradients`` raises on a non-finite norm by default: the guard decides at ``fabric.backward``, so the
    loop never sees the bad gradients; the rollback leaves the run exactly where leaving the batch out would."""
    guard = NumGuard(dirpath=str(tmp_path / "ng"), emit_warnings=False)
    net = fit(fabric_of(guard), batches(), together=together, nan_grad_at=2)
    guard.close()
    assert [(e["kind"], e["step"], e["where"], e["action"]) for e in guard.events] == [
        ("nonfinite_grad", 2, ["body.0.weight"], "rollback")
    ]
    assert guard.counters["rollbacks"] == 1 and guard.counters["skipped_steps"] == 1
    reference = fit(fabric_of(None), batches(), together=together, skip=2)
    got, want = weights(net), weights(reference)
    assert all(torch.equal(got[k], want[k]) for k in want), "the rollback is not the batch left out"
    lines = (tmp_path / "ng" / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["nonfinite_grad"]
    # last_finite.ckpt is a Fabric checkpoint: fabric.load puts the model, the optimizer and the guard's state back
    fabric = fabric_of(None)
    fresh = Net()
    model, optimizer = fabric.setup(fresh, torch.optim.AdamW(fresh.parameters()))
    restored = NumGuard()
    fabric.load(tmp_path / "ng" / "last_finite.ckpt", {"model": model, "optimizer": optimizer, "numguard": restored})
    assert restored.counters["rollbacks"] == 1
    assert all(bool(torch.isfinite(v).all()) for v in fresh.state_dict().values())


def test_the_step_is_counted_per_optimizer_step_under_accumulation_and_the_bad_micro_batch_named(tmp_path: Path):
    guard = NumGuard(dirpath=str(tmp_path), emit_warnings=False)
    net = fit(fabric_of(guard), batches(8, bad=3), accumulate=2)  # window 1's second micro-batch
    guard.close()
    first = guard.events[0]
    assert (first["kind"], first["where"], first["step"], first["batch_idx"]) == (
        "nonfinite_input",
        ["batch['x']"],
        1,
        3,
    )
    assert {e["step"] for e in guard.events} == {1} and guard.counters["skipped_steps"] == 1
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())


def test_a_halt_saves_the_last_finite_state_raises_and_unhooks(tmp_path: Path):
    guard = NumGuard(action="halt", dirpath=str(tmp_path), emit_warnings=False)
    fabric = fabric_of(guard)
    with pytest.raises(NonFiniteError, match=r"halted training at step 3.*fabric\.load\("):
        fit(fabric, batches(bad=3))
    assert guard.events[0]["action"] == "halt"
    assert (tmp_path / "last_finite.ckpt").is_file()
    assert not {"backward", "no_backward_sync", "setup_optimizers"} & set(vars(fabric))  # Fabric's own again


def test_evaluation_passes_are_left_alone(tmp_path: Path):
    guard = NumGuard(dirpath=str(tmp_path), emit_warnings=False)
    fabric = fabric_of(guard)
    net = Net()
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    bad = torch.full((2, 4), float("nan"))
    model.eval()
    model(bad)
    model.train()
    with torch.no_grad():
        model(bad)
    guard.close()
    assert guard.events == []


def test_a_setup_the_guard_never_saw_is_named(tmp_path: Path):
    guard = NumGuard(dirpath=str(tmp_path))
    fabric = fabric_of(guard)
    net = Net()
    model = fabric.setup_module(net)  # calls no callback
    optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 4)).sum())
    with pytest.raises(NumGuardConfigError, match=r"on_after_setup never ran.*fabric\.setup\(model, optimizer\)"):
        optimizer.step()


def test_an_optimizer_fabric_never_set_up_is_named(tmp_path: Path):
    fabric = fabric_of(NumGuard(dirpath=str(tmp_path)))
    model = fabric.setup(Net())
    with pytest.raises(NumGuardConfigError, match=r"first training forward pass but no optimizer.*setup_optimizers"):
        model(torch.randn(2, 4))


def test_an_argument_that_does_not_apply_to_fabric_is_refused():
    with pytest.raises(NumGuardConfigError, match=r"sync_mode='deferred'.*does not apply to a Fabric loop"):
        NumGuard(sync_mode="deferred")
    with pytest.raises(NumGuardConfigError, match=r"action.*'explode'"):
        NumGuard(action="explode")


def test_files_and_tensorboard_go_to_the_fabric_loggers_log_dir(tmp_path: Path):
    from lightning.fabric.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(root_dir=tmp_path, name="tb")
    guard = NumGuard(emit_warnings=False)
    fit(fabric_of(guard, loggers=[logger]), batches(bad=2))
    guard.close()
    folder = Path(logger.log_dir) / "numguard"
    assert json.loads((folder / "events.jsonl").read_text().splitlines()[0])["kind"] == "nonfinite_input"
    tags = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0}).Reload().Tags()
    assert "numguard/events/text_summary" in tags["tensors"], tags
    assert {"numguard/incidents", "numguard/rollbacks"} <= set(tags["scalars"]), tags


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(idx))


def _compiled_fit(guard: NumGuard | None, bad: bool = True) -> tuple[nn.Module, int]:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    fabric = fabric_of(guard)
    net = TokenModel()
    model, optimizer = fabric.setup(torch.compile(net, backend="eager"), torch.optim.AdamW(net.parameters()))
    g = torch.Generator().manual_seed(2)
    for i in range(5):
        idx, target = torch.randint(0, 16, (2, 2, 6), generator=g)
        if i == 3 and bad:
            idx[1, 4] = 19  # past the vocabulary: unguarded, the compiled call raises
        loss = F.cross_entropy(model(idx).flatten(0, 1), target.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return net, int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_a_token_id_past_the_vocabulary_inside_a_compiled_model_is_refused_and_named(tmp_path: Path):
    """Inside a compiled region the op guard cannot see ``F.embedding``; the embedding's pre-hook is traced in."""
    guard = NumGuard(dirpath=str(tmp_path), emit_warnings=False, check=["inputs", "ops", "loss", "grads"])
    net, graphs = _compiled_fit(guard)
    guard.close()
    (event,) = guard.events
    assert (event["kind"], event["op"], event["module"], event["step"]) == ("op_domain", "embedding", "wte", 3)
    assert event["details"]["rule"] == "index in [0, 16)" and event["details"]["max"] == 19
    assert event["details"]["first_indices"] == [[1, 4]]
    _, unguarded = _compiled_fit(None, bad=False)
    assert graphs == unguarded  # the door's hooks add no graph and no recompile


def test_unguarded_both_faults_kill_the_loop() -> None:
    """Control: the same loops without the guard die of the same faults, as LitGPT's did."""
    with pytest.raises(RuntimeError, match=r"total norm of order 2\.0 .* is non-finite, so it cannot be clipped"):
        fit(fabric_of(None), batches(), nan_grad_at=2)
    with pytest.raises(IndexError, match="index out of range"):
        _compiled_fit(None)


def test_every_hook_and_wrapped_method_is_removed_at_close(tmp_path: Path) -> None:
    guard = NumGuard(dirpath=str(tmp_path), emit_warnings=False)
    fabric = fabric_of(guard)
    net = fit(fabric, batches(2))
    assert {"backward", "no_backward_sync", "setup_optimizers"} <= set(vars(fabric))
    guard.close()
    assert not {"backward", "no_backward_sync", "setup_optimizers"} & set(vars(fabric))
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules()) == 0
