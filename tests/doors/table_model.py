"""The model and data of the three-door table: one fault at step 2, chosen by the data (or the optimizer), the same
model code whatever loop runs it.

The model is a ``LightningModule`` whose ``forward(x, y, s)`` returns the loss, so that a Trainer
(``training_step`` calls it), a Fabric loop and a plain loop (``loss = model(**batch)``) run the same code; every
fault is made by the batch of step 2 (or by the optimizer after step 1), never by the loop:

=========  ==========================================================================================
fault      what goes wrong at step 2
=========  ==========================================================================================
input      ``x`` holds a NaN
output     ``x[:, 0]`` is below -1 in one row: ``mid``'s ``torch.log`` writes a NaN
param      the optimizer left a NaN in ``head.weight`` after step 1
op         ``s`` is 2: ``scale`` pushes the probabilities above 1 before ``binary_cross_entropy``
std        every row of ``x`` is the same: ``norm`` divides by a zero ``std``
sqrt       one row of ``x`` is zero: ``radius``'s ``sqrt(0)`` is finite, its backward is not
=========  ==========================================================================================
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

FAULTS = ("input", "output", "param", "op", "std", "sqrt")
BATCH = 4
STEPS = 4


class Mid(nn.Module):
    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h * torch.log(x[:, :1] + 1)  # x[:, 0] > -1 on clean batches


class Norm(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h - h.mean(0)) / h.std(0)  # a zero std when every row is the same


class Radius(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.sqrt((h * h).sum(-1, keepdim=True))  # sqrt(0) where a row is zero


class Scale(nn.Module):
    def forward(self, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return p * s  # s is 1 on clean batches


class TableModel(pl.LightningModule):
    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.body = nn.Linear(4, 8, bias=False)
        self.mid = Mid()
        self.norm = Norm()
        self.radius = Radius()
        self.head = nn.Linear(8, 1)
        self.scale = Scale()

    def forward(self, x: torch.Tensor, y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        h = self.radius(h)
        h = self.mid(h, x)
        h = self.norm(h)
        p = self.scale(torch.sigmoid(self.head(h)), s)
        return F.binary_cross_entropy(p, y)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["x"], batch["y"], batch["s"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self, self.fault)


class NaNAfterStep(torch.optim.SGD):
    """SGD that leaves a NaN in ``head.weight`` after its ``nan_after``-th step (0: never)."""

    def __init__(self, params: Any, weight: torch.Tensor, nan_after: int) -> None:
        super().__init__(params, lr=0.05)
        self.weight, self.nan_after, self.calls = weight, nan_after, 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        self.calls += 1
        if self.calls == self.nan_after:
            self.weight.view(-1)[0] = float("nan")
        return out


def make_optimizer(model: TableModel, fault: str) -> torch.optim.Optimizer:
    return NaNAfterStep(model.parameters(), model.head.weight, 2 if fault == "param" else 0)


class TableData(Dataset):
    """``STEPS`` batches of ``BATCH`` samples ``{"x", "y", "s"}``; batch 2 carries ``fault``."""

    def __init__(self, fault: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(STEPS * BATCH, 4, generator=g) + 0.5
        self.y = torch.rand(STEPS * BATCH, 1, generator=g).round()
        self.s = torch.ones(STEPS * BATCH, 1)
        rows = slice(2 * BATCH, 3 * BATCH)
        if fault == "input":
            self.x[2 * BATCH, 1] = float("nan")
        elif fault == "output":
            self.x[2 * BATCH + 1, 0] = -2.0
        elif fault == "op":
            self.s[rows] = 2.0
        elif fault == "std":
            self.x[rows] = self.x[2 * BATCH]
        elif fault == "sqrt":
            self.x[2 * BATCH + 1] = 0.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "s": self.s[i]}


def loader(fault: str) -> DataLoader:
    return DataLoader(TableData(fault), batch_size=BATCH, shuffle=False)


def event_rows(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What must be the same through every door: kind, where, op, source line, action (in order)."""
    return [(e["kind"], tuple(e["where"]), e.get("op"), e.get("source"), e["action"]) for e in events]
