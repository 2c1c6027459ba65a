"""Every private access in ``_compat``: what it reads, and what happens when the name is gone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torchmetrics

from lightning_numguard import NumGuardCallback, NumGuardError, _compat
from tests.helpers import FaultData, FaultModel, loader, trainer


def fake_trainer(accumulate: int, epoch_loop: object) -> SimpleNamespace:
    return SimpleNamespace(accumulate_grad_batches=accumulate, fit_loop=SimpleNamespace(epoch_loop=epoch_loop))


def test_no_private_name_is_read_without_accumulation():
    t = fake_trainer(1, object())  # no _should_accumulate at all
    _compat.require_accumulation_api(t)
    assert _compat.should_accumulate(t) is False


def test_accumulation_without_the_private_name_is_refused_not_guessed():
    with pytest.raises(NumGuardError, match=r"_should_accumulate\(\).*accumulate_grad_batches=1"):
        _compat.require_accumulation_api(fake_trainer(4, object()))


def test_accumulation_reads_lightnings_own_answer():
    loop = SimpleNamespace(_should_accumulate=lambda: True)
    _compat.require_accumulation_api(fake_trainer(4, loop))
    assert _compat.should_accumulate(fake_trainer(4, loop)) is True


def test_a_missing_accumulation_api_stops_a_real_fit_at_setup(tmp_path, monkeypatch):
    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    monkeypatch.delattr(_TrainingEpochLoop, "_should_accumulate")
    t = trainer(tmp_path, [NumGuardCallback(dirpath=str(tmp_path / "ng"))], max_steps=2, accumulate_grad_batches=2)
    with pytest.raises(NumGuardError, match="accumulate_grad_batches"):
        t.fit(FaultModel(), loader(FaultData()))


@pytest.mark.parametrize(
    ("min_steps", "min_epochs", "step", "epoch", "expected"),
    [(None, None, 0, 0, True), (10, None, 5, 0, False), (10, None, 10, 0, True), (None, 2, 99, 1, False)],
)
def test_lightning_will_stop_has_a_public_fallback(min_steps, min_epochs, step, epoch, expected):
    t = SimpleNamespace(
        fit_loop=object(), min_steps=min_steps, min_epochs=min_epochs, global_step=step, current_epoch=epoch
    )
    assert _compat.lightning_will_stop(t) is expected


def test_metric_counters_round_trip():
    metric = torchmetrics.MeanMetric()
    metric.update(torch.tensor([1.0]))
    count, computed = _compat.metric_counters(metric)
    assert count == 1
    metric.update(torch.tensor([3.0]))
    _compat.set_metric_counters(metric, count, computed)
    assert metric.update_count == 1


def test_foreach_norm_matches_per_tensor_norms():
    tensors = [torch.randn(5), torch.randn(2, 3, dtype=torch.float64)]
    norms = _compat.foreach_norm_f32(tensors[:1])
    assert torch.allclose(norms[0], tensors[0].norm())
    dst = [torch.zeros(5)]
    _compat.foreach_copy_(dst, tensors[:1])
    assert torch.equal(dst[0], tensors[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_flat_norm_is_the_global_norm_of_tensors_of_any_floating_dtype(dtype):
    torch.manual_seed(0)
    tensors = [torch.randn(4, 3).to(dtype), torch.randn(7).to(dtype), torch.randn(2, 2, 2).to(dtype).transpose(0, 2)]
    norm = _compat.flat_norm_f32(tensors)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    expected = torch.linalg.vector_norm(torch.stack([t.double().norm() for t in tensors]))
    assert torch.allclose(norm.double(), expected, rtol=1e-3)
    tensors[1][3] = float("nan")  # one non-finite value makes the global norm non-finite
    assert not torch.isfinite(_compat.flat_norm_f32(tensors))


def test_nn_bindings_is_the_raw_namespace():
    assert _compat.nn_bindings() is torch._C._nn


# ------------------------------------------------------------------------------ Tensor.to's device


TO_CALLS = [
    (("cpu",), {}, torch.device("cpu")),
    (("meta", torch.float16), {}, torch.device("meta")),
    ((torch.device("meta"),), {"non_blocking": True}, torch.device("meta")),
    ((), {"device": "meta", "dtype": torch.float16}, torch.device("meta")),
    ((torch.ones(1, device="meta"),), {}, torch.device("meta")),
    ((torch.float16,), {}, None),
    ((), {"dtype": torch.float16}, None),
]


@pytest.mark.parametrize("without_parser", [False, True], ids=["parser", "public-fallback"])
@pytest.mark.parametrize(("args", "kwargs", "expected"), TO_CALLS)
def test_to_target_device_reads_every_overload(monkeypatch, without_parser, args, kwargs, expected):
    if without_parser:
        monkeypatch.delattr(torch._C._nn, "_parse_to")
    assert _compat.to_target_device(*args, **kwargs) == expected


@pytest.mark.parametrize("without_parser", [False, True], ids=["parser", "public-fallback"])
def test_to_target_device_refuses_what_tensor_to_refuses(monkeypatch, without_parser):
    if without_parser:
        monkeypatch.delattr(torch._C._nn, "_parse_to")
    with pytest.raises(RuntimeError, match="nonsense"):
        torch.ones(1).to("nonsense")
    with pytest.raises(RuntimeError, match="nonsense"):
        _compat.to_target_device("nonsense")


# ------------------------------------------------------------------------- the device-side skip


def _adamw(**kwargs):
    return torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), **kwargs)


def test_only_fused_optimizers_honour_found_inf():
    assert _compat.step_honours_found_inf(_adamw(fused=True))
    assert _compat.step_honours_found_inf(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, fused=True))
    assert not _compat.step_honours_found_inf(_adamw(foreach=False))
    assert not _compat.step_honours_found_inf(_adamw(foreach=True))
    assert not _compat.step_honours_found_inf(torch.optim.RMSprop(torch.nn.Linear(2, 2).parameters()))


def test_a_fused_optimizer_without_the_private_flag_is_not_trusted():
    opt = _adamw(fused=True)
    del opt._step_supports_amp_scaling
    assert not _compat.step_honours_found_inf(opt)


def test_found_inf_is_set_and_cleared_as_the_grad_scaler_does():
    opt = _adamw(fused=True)
    _compat.set_found_inf(opt, torch.tensor([True]))
    assert opt.found_inf.dtype == torch.float32 and opt.found_inf.shape == () and opt.found_inf.item() == 1.0
    assert opt.grad_scale is None
    _compat.clear_found_inf(opt)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    _compat.clear_found_inf(opt)  # disarming twice is harmless


# ---------------------------------------------------------------------------------------- frames


def _frames_seen_from_inner():
    def inner():
        return _compat.caller_frame(), _compat.caller_frame(1), _compat.caller_frame(10**6)

    return inner()


@pytest.mark.parametrize("without_getframe", [False, True], ids=["sys._getframe", "inspect-fallback"])
def test_caller_frame_is_what_getframe_returns_in_the_caller(monkeypatch, without_getframe):
    if without_getframe:
        monkeypatch.setattr(_compat, "_getframe", None)
    own, caller, too_deep = _frames_seen_from_inner()
    assert own.f_code.co_name == "inner"
    assert caller.f_code is _frames_seen_from_inner.__code__
    assert too_deep is None


def test_first_frame_walks_outwards_from_the_frame_itself_to_the_first_match():
    def inner():
        return _compat.caller_frame()

    def outer():
        return inner()

    own = outer()  # inner's frame, whose f_back is outer's
    assert _compat.first_frame(own, lambda f: f.f_code.co_name == "inner") is own
    assert _compat.first_frame(own, lambda f: f.f_code.co_name == "outer").f_code is outer.__code__
    here = test_first_frame_walks_outwards_from_the_frame_itself_to_the_first_match.__code__
    assert _compat.first_frame(own, lambda f: f.f_code is here).f_code is here
    assert _compat.first_frame(own, lambda f: False) is None
    assert _compat.first_frame(None, lambda f: True) is None


class _Owner:
    def run(self, fn):
        return fn()


@pytest.mark.parametrize("without_getframe", [False, True], ids=["sys._getframe", "inspect-fallback"])
def test_calling_owner_names_the_innermost_known_self(monkeypatch, without_getframe):
    if without_getframe:
        monkeypatch.setattr(_compat, "_getframe", None)
    a, b, root, stranger = _Owner(), _Owner(), _Owner(), _Owner()
    names = {id(a): "a", id(b): "a.b", id(root): ""}
    assert a.run(lambda: _compat.calling_owner(names, 0)) == "a"
    assert a.run(lambda: b.run(lambda: _compat.calling_owner(names, 0))) == "a.b"
    assert a.run(lambda: stranger.run(lambda: _compat.calling_owner(names, 0))) == "a"  # an unknown self is passed
    assert root.run(lambda: _compat.calling_owner(names, 0)) is None  # the root module: "" -> None
    assert a.run(lambda: root.run(lambda: _compat.calling_owner(names, 0))) is None  # innermost wins
    assert _compat.calling_owner(names, 0) is None  # no known self on the stack
    # ``skip`` starts the walk further out: 2 starts at the outer lambda (past the inner one and b.run)
    assert a.run(lambda: b.run(lambda: _compat.calling_owner(names, 1))) == "a.b"
    assert a.run(lambda: b.run(lambda: _compat.calling_owner(names, 2))) == "a"
    assert a.run(lambda: _compat.calling_owner(names, 10**6)) is None


def test_calling_owner_names_the_running_module_of_a_real_forward():
    seen = []

    class Leaf(torch.nn.Module):
        def forward(self, x):
            seen.append(_compat.calling_owner(names, 0))
            return torch.relu(x)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Leaf())
    names = {id(m): n for n, m in model.named_modules()}
    model(torch.ones(1, 2))
    assert seen == ["1"]
