"""The failures of ../shared/seeds/, each caught, named and survived in a real Trainer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import all_finite, guard_warning, trainer

BAD_STEP = 3


class TwoModels(pl.LightningModule):
    """The RCAN post: model A's output feeds model B, whose sigmoid feeds nn.BCELoss."""

    def __init__(self) -> None:
        super().__init__()
        self.model_a = nn.Module()
        self.model_a.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
        self.model_b = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
        self.criterion = nn.BCELoss()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.model_a.body(x)
        return self.criterion(self.model_b(h), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Blowup(TwoModels):
    """model_a.body.3 starts producing NaN at BAD_STEP (weights poisoned from outside)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == BAD_STEP:
            with torch.no_grad():
                self.model_a.body[3].bias.fill_(float("nan"))


def data(n: int = 64, fill: float | None = None) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (torch.rand(n, 1, generator=g) > 0.5).float()
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_bceloss_never_sees_the_upstream_nan_and_names_it(tmp_path):
    model = Blowup()
    plain = trainer(tmp_path / "plain", [], max_steps=6)
    with pytest.raises(RuntimeError, match="all elements of input should be between 0 and 1"):
        plain.fit(Blowup(), data())  # what the seed post saw (on CUDA: a device-side assert)

    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match=guard_warning("`model_a.body.3.bias`", BAD_STEP)):
        t = trainer(tmp_path, [guard], max_steps=8)
        t.fit(model, data())
    assert t.global_step == 8 and all_finite(model.state_dict())
    kinds = [e["kind"] for e in guard.events if e["step"] == BAD_STEP]
    assert kinds[0] == "nonfinite_param" and guard.events[0]["where"] == ["model_a.body.3.bias"]
    assert "nonfinite_output" in kinds and "op_domain" in kinds
    (op,) = [e for e in guard.events if e["kind"] == "op_domain"]
    assert op["where"] == ["binary_cross_entropy"] and op["module"] == "criterion"  # issue 10: one kind of name
    assert "BCEWithLogitsLoss" in op["message"]
    assert "first non-finite module was `model_a.body.3`" in op["message"]
    out = next(e for e in guard.events if e["kind"] == "nonfinite_output")
    assert out["where"][0] == "model_a.body.3"


def test_bce_on_unbounded_outputs_is_an_op_domain_incident(tmp_path):
    class NoSigmoid(TwoModels):
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.model_b[0](self.model_a.body(x))  # forgot the sigmoid
            if self.global_step == BAD_STEP:
                out = out + 5.0
            return nn.functional.binary_cross_entropy(out.clamp_min(0), y)

    guard = NumGuardCallback(action="skip", dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="binary_cross_entropy"):
        trainer(tmp_path, [guard], max_steps=6).fit(NoSigmoid(), data())
    ops = [e for e in guard.events if e["kind"] == "op_domain"]
    assert ops and ops[0]["where"] == ["binary_cross_entropy"]
    assert ops[0]["details"]["count"] > 0 and ops[0]["details"]["max"] > 1
    assert ops[0]["action"] == "skip"


def test_frozen_layers_handed_to_the_optimizer(tmp_path):
    class Rcan(TwoModels):
        def configure_optimizers(self):
            self.model_a.body[0].requires_grad_(False)  # a fixed layer (RCAN's MeanShift)
            return torch.optim.Adam(self.parameters(), weight_decay=1e-4)  # all params, as in the post

    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="frozen parameters"):
        t = trainer(tmp_path, [guard], max_steps=4)
        t.fit(Rcan(), data())
    (event,) = guard.events
    assert event["kind"] == "optimizer_coverage"
    assert event["where"] == ["model_a.body.0.weight", "model_a.body.0.bias"]
    assert "p.requires_grad" in event["message"]
    assert t.global_step == 4


class Standardize(nn.Module):
    """`(x - mean) / std` without an eps: the seed post's "division by a zero std"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)


class RmsNorm(nn.Module):
    """`sqrt(var)` without an eps: finite forward at 0, but an infinite sqrt backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.var(x, dim=1, unbiased=False, keepdim=True).sqrt()


class NormModel(pl.LightningModule):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.norm = norm
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.encoder(x)
        if self.global_step == BAD_STEP:
            h = h * 0 + 0.5  # constant features: std 0, var 0
        return nn.functional.mse_loss(self.head(self.norm(h)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_division_by_a_zero_std(tmp_path):
    model = NormModel(Standardize())
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="division by a zero std"):
        t = trainer(tmp_path, [guard], max_steps=8)
        t.fit(model, data())
    first = guard.events[0]
    assert first["kind"] == "nonfinite_output" and first["step"] == BAD_STEP
    assert first["where"] == ["norm"] and first["op"] == "div"  # issue 10: the op in its own field
    assert first["source"].endswith("test_seed_stories.py:117")  # the user's line, not the guard's
    assert "replay traced it to op `div` in `norm`" in first["message"]
    assert t.global_step == 8 and all_finite(model.state_dict())


def test_sqrt_of_zero_in_a_norms_backward(tmp_path):
    model = NormModel(RmsNorm())
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="SqrtBackward0"):
        t = trainer(tmp_path, [guard], max_steps=8)
        t.fit(model, data())
    first = guard.events[0]
    assert first["kind"] == "nonfinite_grad" and first["step"] == BAD_STEP  # the forward was finite
    assert first["op"] == "SqrtBackward0" and first["module"] == "norm"  # issue 10: op and module in own fields
    assert first["details"]["replay"]["op"] == "SqrtBackward0"
    assert "sqrt" in first["message"] and "eps" in first["message"]
    assert t.global_step == 8 and all_finite(model.state_dict())


def test_masked_array_fill_values_leaking_into_the_batch(tmp_path):
    values = np.ma.masked_array(np.random.default_rng(0).normal(size=(8, 4)), mask=False)
    values[2, 1] = np.ma.masked
    plain = np.concatenate([values, values])  # not mask-aware: no fill value shows up here
    assert plain.max() < 1e20
    raw = np.ma.getdata(np.ma.concatenate([values, values]).filled())  # filled(): 1e20 in both masked cells
    assert np.count_nonzero(raw == 1e20) == 2
    assert raw.max() == pytest.approx(1e20)
    x = torch.randn(64, 4)
    x[BAD_STEP * 8 : BAD_STEP * 8 + 16] = torch.from_numpy(raw).float()
    y = torch.rand(64, 1).round()
    model = TwoModels()
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="masked-array fill value"):
        t = trainer(tmp_path, [guard], max_steps=8)
        t.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    first = guard.events[0]
    assert first["kind"] == "suspicious_input" and first["where"] == ["batch[0]"]
    assert first["step"] == BAD_STEP
    assert first["details"]["max_abs"] == pytest.approx(1e20, rel=1e-6)
    assert "numpy's masked-array default fill value 1e20" in first["message"]
    assert guard.counters["rollbacks"] == 2  # batches 3 and 4 both hold fill values
    assert t.global_step == 8 and all_finite(model.state_dict())


class Classifier(pl.LightningModule):
    def __init__(self, bad: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)
        self.bad = bad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        if self.global_step == BAD_STEP:
            if self.bad == "label":
                labels = labels.clone()
                labels[0] = 10  # one class too many
            else:
                tokens = tokens.clone()
                tokens[1] = 12  # beyond the vocabulary
        return nn.functional.cross_entropy(self.head(self.emb(tokens)), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("bad", "op", "module"), [("label", "cross_entropy", None), ("token", "embedding", "emb")])
def test_index_out_of_range_is_refused_before_the_kernel(tmp_path, bad, op, module):
    tokens = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens, tokens.clone()), batch_size=8)
    with pytest.raises((IndexError, RuntimeError), match=r"out of (bounds|range)"):
        trainer(tmp_path / "plain", [], max_steps=6).fit(Classifier(bad), loader)

    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    model = Classifier(bad)
    with pytest.warns(NumGuardWarning, match=op):
        t = trainer(tmp_path, [guard], max_steps=6)
        t.fit(model, loader)
    (event,) = [e for e in guard.events if e["kind"] == "op_domain"]
    assert event["where"] == [op] and event["module"] == module  # issue 10: the module in its own field
    assert event["details"]["count"] == 1 and event["action"] == "rollback"
    assert t.global_step == 6 and all_finite(model.state_dict())


def test_op_guard_can_be_turned_off(tmp_path):
    tokens = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens, tokens.clone()), batch_size=8)
    guard = NumGuardCallback(check=["inputs", "outputs", "loss", "grads", "params"], dirpath=str(tmp_path / "ng"))
    with pytest.raises(IndexError, match="out of bounds"):
        trainer(tmp_path, [guard], max_steps=6).fit(Classifier("label"), loader)
    assert torch.overrides._get_current_function_mode_stack() == []
