"""Every word the guard shows about a culprit is true (issue 20, items 2 and 3).

* a fully masked attention row (all ``-inf`` -> softmax -> NaN): ``where``, the summary and the Rich table
  name the module that ran the softmax, the message does not call ``-inf`` "finite", and the hint is about
  masking;
* a NaN written into the batch inside ``training_step``: the message does not both say that no op in the
  module is to blame and send the user looking in that module for a zero std.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_numguard import NumGuardCallback, NumGuardWarning
from lightning_numguard.reporting.hints import KIND_HINTS
from lightning_numguard.reporting.summary import rich_table, summarize, summary_text
from tests.helpers import all_finite, trainer

BAD_STEP = 3
_SOURCE = Path(__file__).read_text().splitlines()


class Attention(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)).masked_fill(~keep[:, None, :], float("-inf"))
        return self.proj(scores.softmax(dim=-1) @ v)  # a row with nothing to attend to: NaN


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, keep)


class Encoder(pl.LightningModule):
    """``fault="masked_row"``: at ``BAD_STEP`` one sequence is fully masked; ``"nan_in_step"``: NaN is written
    into the batch inside ``training_step``."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block()])
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, keep = batch[0], batch[1].bool()
        if self.global_step == BAD_STEP and self.fault == "masked_row":
            keep = keep.clone()
            keep[0] = False
        if self.global_step == BAD_STEP and self.fault == "nan_in_step":
            x = x.clone()
            x[0, 0, 0] = float("nan")
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, keep)
        return self.head(h).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path: Any, fault: str) -> tuple[NumGuardCallback, Encoder]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 5, 4, generator=g), torch.ones(48, 5))
    model = Encoder(fault)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    with pytest.warns(NumGuardWarning):
        trainer(tmp_path, [guard], max_steps=6).fit(model, DataLoader(data, batch_size=8))
    return guard, model


def test_a_fully_masked_row_names_the_module_that_ran_the_softmax(tmp_path):
    """Before: ``where`` was ``blocks.0.attn.proj`` (the next layer), "from finite inputs", a zero-std hint."""
    guard, model = _fit(tmp_path, "masked_row")
    first = guard.events[0]
    assert (first["kind"], first["step"], first["op"]) == ("nonfinite_output", BAD_STEP, "softmax")
    assert first["where"] == ["blocks.0.attn"] and first["module"] == "blocks.0.attn"
    line = next(i for i, text in enumerate(_SOURCE, 1) if "scores.softmax(dim=-1)" in text)
    assert first["source"].endswith(f"test_true_words.py:{line}")
    message = first["message"]
    assert "from finite inputs" not in message and "±Inf" in message
    assert "fully masked" in message and "finfo" in message
    assert KIND_HINTS["nonfinite_output"] not in message  # not the zero-std / sqrt-of-0 advice
    summary = summarize(guard.events, guard.counters, 0, 6, None)
    text = summary_text(summary)
    assert "  nonfinite_output in blocks.0.attn (op softmax)  x1   step 3\n" in text
    console = Console(file=io.StringIO(), width=200)
    console.print(rich_table(summary))
    rendered = console.file.getvalue()
    assert "blocks.0.attn " in rendered and "attn.proj" not in rendered
    assert all_finite(model.state_dict())


def test_nan_written_into_the_batch_in_training_step_says_one_consistent_thing(tmp_path):
    """The in-place write of a NaN literal is the culprit, at its line; the module that received it is a consequence.

    Before: the root cause named `inp`, which only received the value ("no op inside it is to blame").
    """
    guard, _ = _fit(tmp_path, "nan_in_step")
    first = guard.events[0]
    assert (first["kind"], first["where"], first["step"]) == ("nonfinite_output", ["Encoder"], BAD_STEP)
    assert (first["op"], first["module"]) == ("__setitem__", "Encoder")
    line = next(i for i, text in enumerate(_SOURCE, 1) if 'x[0, 0, 0] = float("nan")' in text)
    assert first["source"].endswith(f"test_true_words.py:{line}")
    message = first["message"]
    assert "own code" in message and "literal" in message and "no op inside it is to blame" not in message
    assert KIND_HINTS["nonfinite_output"] not in message and "zero std" not in message
    received = next(e for e in guard.events if e["where"] == ["inp"])
    assert received["root_cause"] is False and "received non-finite values from `Encoder`" in received["message"]
