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


def test_nn_bindings_is_the_raw_namespace():
    assert _compat.nn_bindings() is torch._C._nn
