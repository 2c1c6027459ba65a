"""No false alarm stops training (issue 20, item 1).

A clean run of a Hugging Face-style model, whose batches carry an additive attention mask filled with
``torch.finfo(dtype).min``, raises nothing and trains; a batch field flagged on step after step is a
convention of the data only when its values are masks (infinities): said once, with the setting that silences
it, and no longer acted on. Anything else in every batch (a fill value, a huge value, NaN) is a broken pipeline:
the guard halts (issue 26).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_numguard import NonFiniteError, NumGuardCallback, NumGuardWarning
from lightning_numguard.detect.conventions import CONVENTION_STEPS
from tests.helpers import trainer

VOCAB, DIM, SEQ = 24, 16, 6


class PaddedTokens(Dataset):
    """Token ids of random lengths, padded, with the additive mask a Hugging Face collator/model builds."""

    def __init__(self, n: int = 80, dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.lens = torch.randint(2, SEQ + 1, (n,), generator=g)
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        keep = torch.arange(SEQ) < self.lens[i]
        ids = torch.where(keep, self.ids[i], 0)
        # (1 - mask) * finfo.min: 0 where attended, the dtype's most negative value at padding
        additive = (1.0 - keep.to(self.dtype)) * torch.finfo(self.dtype).min
        return {"input_ids": ids, "attention_mask": additive[None, :]}


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM) + additive_mask.to(x.dtype)  # added to the scores
        return self.proj(scores.softmax(dim=-1) @ v)


class TinyGPT(pl.LightningModule):
    """Embedding, one attention block, a head: the shape of a small GPT/BERT with an additive padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([SelfAttention()])
        self.head = nn.Linear(DIM, VOCAB)
        self.snapshots: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = self.emb(batch["input_ids"])
        for block in self.blocks:
            x = x + block(x, batch["attention_mask"])
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten(), ignore_index=0)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.snapshots.append(torch.cat([p.detach().flatten() for p in self.parameters()]).clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _moved_every_step(model: TinyGPT, start: torch.Tensor) -> list[bool]:
    before = [start, *model.snapshots[:-1]]
    return [not torch.equal(a, b) for a, b in zip(before, model.snapshots)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hugging_face_additive_mask_raises_nothing_and_trains(tmp_path, dtype):
    """Before: ``suspicious_input`` in ``batch['attention_mask']`` on 10 of 10 steps, each rolled back."""
    model = TinyGPT()
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))  # the defaults
    t = trainer(tmp_path, [guard], max_steps=10)
    t.fit(model, DataLoader(PaddedTokens(dtype=dtype), batch_size=8))
    assert guard.events == []
    assert guard.counters == {"incidents": 0, "skipped_steps": 0, "rollbacks": 0, "amp_overflow_steps": 0, "spikes": 0}
    assert t.global_step == 10 and len(model.snapshots) == 10
    assert all(_moved_every_step(model, start))


class SentinelData(Dataset):
    """``x``/``y`` regression data and a field the model never reads, holding ``value`` in every sample."""

    def __init__(self, value: float, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        self.value = value

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "extra": torch.tensor([self.value, 0.0])}


class Regressor(pl.LightningModule):
    """Reads ``x`` and ``y`` only; targets marked missing with NaN are left out of the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.snapshots: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        y = batch["y"]
        known = ~torch.isnan(y)
        return F.mse_loss(self.net(batch["x"])[known], y[known])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.snapshots.append(self.net.weight.detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("value", [float("-inf"), float("inf")])
def test_a_field_flagged_step_after_step_is_a_convention(tmp_path, value):
    """Before: every step skipped or rolled back, no progress at all, and no word that it was a convention."""
    kind, setting = "nonfinite_input", "without 'inputs'"
    model = Regressor()
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning) as caught:
        trainer(tmp_path, [guard], max_steps=8).fit(model, DataLoader(SentinelData(value), batch_size=8))
    field = "batch['extra']"
    steps = [e["step"] for e in guard.events]
    assert steps == list(range(CONVENTION_STEPS)), guard.events  # flagged until declared, then never again
    assert all(e["kind"] == kind and e["where"] == [field] for e in guard.events)
    acted, declared = guard.events[:-1], guard.events[-1]
    assert [e["action"] for e in acted] == ["rollback"] * (CONVENTION_STEPS - 1)
    assert declared["action"] == "none" and declared["details"]["convention"] == {"steps": CONVENTION_STEPS}
    assert "convention" in declared["message"] and setting in declared["message"] and field in declared["message"]
    said = [str(w.message) for w in caught if "convention" in str(w.message)]
    assert len(said) == 1 and field in said[0] and setting in said[0]  # said once, naming field and setting
    assert guard.counters["incidents"] == CONVENTION_STEPS - 1  # the declaration is no incident
    # from the declaring step on, every step trains
    moved = [not torch.equal(a, b) for a, b in zip(model.snapshots, model.snapshots[1:])]
    assert all(moved[CONVENTION_STEPS - 2 :]), moved


class Clamping(Regressor):
    """Reads ``extra`` too, clamped: a fill value in it leaves the loss finite (the seeds' story)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(10, 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = torch.cat([batch["x"], batch["extra"].nan_to_num(0.0).clamp(-10, 10)], dim=-1)
        return F.mse_loss(self.net(x), batch["y"])


@pytest.mark.parametrize(
    ("value", "kind", "words"),
    [
        (1e20, "suspicious_input", "looks like a masked-array fill value leaked into the batch (numpy's"),
        (9.969209968386869e36, "suspicious_input", "netCDF's default float fill value"),
        (1e25, "suspicious_input", "suspiciously large finite value 1e+25"),
        (float("nan"), "nonfinite_input", "non-finite value in `batch['extra']` at step 2 on rank 0 (8 NaN"),
    ],
)
def test_a_value_in_every_batch_that_is_no_mask_halts_as_a_broken_pipeline(tmp_path, value, kind, words):
    """The seeds' story (``seeds/003``: ``np.concatenate`` of masked arrays drops the mask, and the fill value
    ``1e+20``, or netCDF's ``9.96921e+36``, reaches the data): a fill value in one feature of every batch, a model
    that clamps its inputs so the loss stays finite. Before: steps 0 and 1 rolled back as a leak, then at step 2 "a convention of this data",
    the field no longer checked, and the rest of the run trained on the poisoned feature."""
    torch.manual_seed(0)
    model = Clamping()
    start = model.net.weight.detach().clone()
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), emit_warnings=False)
    with pytest.raises(NonFiniteError) as raised:
        trainer(tmp_path, [guard], max_steps=8).fit(model, DataLoader(SentinelData(value), batch_size=8))
    steps = list(range(CONVENTION_STEPS))
    assert [(e["step"], e["kind"], e["where"]) for e in guard.events] == [(s, kind, ["batch['extra']"]) for s in steps]
    assert [e["action"] for e in guard.events] == ["rollback"] * (CONVENTION_STEPS - 1) + ["halt"]
    assert not any(e["details"].get("convention") for e in guard.events)  # a leak is never taken for a convention
    last = guard.events[-1]
    assert last["details"]["persistent"] == {"steps": CONVENTION_STEPS}
    assert words in last["message"] and f"flagged on {CONVENTION_STEPS} consecutive steps" in last["message"]
    assert "data pipeline is broken" in last["message"] and "fix the data" in last["message"]
    message = str(raised.value)
    assert f"halted training at step {CONVENTION_STEPS - 1}" in message and "data pipeline is broken" in message
    assert "ckpt_path=" in message
    assert (guard.counters["rollbacks"], guard.counters["incidents"]) == (CONVENTION_STEPS - 1, CONVENTION_STEPS)
    assert torch.equal(model.net.weight, start)  # no step ever trained on the poisoned feature


def test_fill_values_in_real_features_are_still_caught_at_the_first_hit(tmp_path):
    """The mask rule does not hide the seeds' fill values: 1e20 next to a finfo.min mask is named at once."""
    data = PaddedTokens(n=32)
    model = TinyGPT()
    model.emb.weight.data[0] = 0.0

    class Leaky(Dataset):
        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            item = dict(data[i])
            item["features"] = torch.full((2,), 9.969209968386869e36 if i // 8 == 1 else 0.5)
            return item

    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning, match="netCDF's default float fill value"):
        trainer(tmp_path, [guard], max_steps=4).fit(model, DataLoader(Leaky(), batch_size=8))
    assert [(e["kind"], e["where"], e["step"]) for e in guard.events] == [
        ("suspicious_input", ["batch['features']"], 1)
    ]
