"""User-style model code, written the way a newcomer writes it: a tiny GPT from scratch and a small tabular net.

Every faulty line ends with ``# FAULT: <tag>``; the rows at the bottom say how each fault is injected (data, a
weight, a hook, a config value) at global step ``BAD_STEP``.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from instruments.diagnosis.real.harness import BAD_STEP, Leaf, Marker, Row, fp16_autocast

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 8


class CausalSelfAttention(nn.Module):
    def __init__(self, attn_scale: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.attn_scale = attn_scale

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.attn_scale * k.size(-1))  # FAULT: attn-scale
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(causal, float("-inf"))
        att = att.masked_fill(pad[:, None, None, :], float("-inf"))
        att = F.softmax(att, dim=-1)  # FAULT: masked-row
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        h = h / h.sum(-1, keepdim=True)  # FAULT: mlp-div
        return self.fc2(h)


class Block(nn.Module):
    def __init__(self, attn_scale: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention(attn_scale)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), pad)
        return x + self.mlp(self.ln2(x))


class TinyGPT(pl.LightningModule):
    """A two-block GPT; ``fault`` picks what goes wrong at ``BAD_STEP``."""

    def __init__(self, fault: str = "", attn_scale: float = 1.0, anneal: float = 0.0) -> None:
        super().__init__()
        self.fault, self.anneal = fault, anneal
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([Block(attn_scale), Block(attn_scale)])
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        x = self.blocks[0](x, pad)
        if self.fault == "between" and self.global_step == BAD_STEP:
            x = x * float("nan")  # FAULT: between-blocks
        x = self.blocks[1](x, pad)
        temperature = max(0.0, 1.0 - self.anneal * self.global_step)  # a schedule that reaches 0
        x = self.ln_f(x) / temperature  # FAULT: temperature
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, pad = batch
        logits = self(idx[:, :-1], pad[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step != BAD_STEP:
            return
        with torch.no_grad():
            if self.fault == "mlp_zero":
                self.blocks[1].mlp.fc1.bias.fill_(-1e3)  # finite, but every ReLU of the block's MLP is now 0
            elif self.fault == "nan_weight":
                self.get_parameter(GPT_NAN_WEIGHT)[0, 0] = float("nan")  # FAULT: nan-weight
        if self.fault == "hook" and not hasattr(self, "_hooked"):
            self._hooked = self.get_submodule(GPT_HOOKED).register_forward_hook(nan_hook)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


GPT_NAN_WEIGHT = "blocks.0.attn.qkv.weight"
GPT_HOOKED = "blocks.1.mlp.fc2"


def nan_hook(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
    """A debugging hook left in: it marks one activation by writing into the module's output in place."""
    out[0, 0] = float("nan")  # FAULT: hook-write


def gpt_data(fully_padded: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (16, SEQ + 1), generator=g)
    pad = torch.zeros(16, SEQ + 1, dtype=torch.bool)
    if fully_padded:
        pad[BAD_STEP * 4 + 1] = True  # an empty sequence: every key of it is padding
    return DataLoader(TensorDataset(idx, pad), batch_size=4)


class FeatureNorm(nn.Module):
    """A hand-written per-sample normalisation."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        if self.mode == "std":
            return (x - mu) / x.std(-1, keepdim=True)  # FAULT: zero-std
        if self.mode == "var":
            std = torch.sqrt((x * x).mean(-1, keepdim=True) - mu * mu)  # FAULT: sqrt-neg
            return (x - mu) / (std + 1e-5)
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # FAULT: rms-sqrt
        return x / (rms + 1e-6)


class Tabular(pl.LightningModule):
    """Features -> (hand-written norm) -> MLP -> regression."""

    def __init__(self, norm: str = "", log_features: bool = False, grow: float = 1.0) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))  # a learned input scale
        self.norm = FeatureNorm(norm) if norm else nn.Identity()
        self.log_features, self.grow = log_features, grow
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log_features:
            x = torch.log(x)  # FAULT: log-zero
        h = self.fc1(self.norm(x * self.gain))  # FAULT: fc1
        return self.fc2(F.relu(h))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == BAD_STEP and self.grow != 1.0:
            with torch.no_grad():
                self.fc1.weight.mul_(self.grow)  # weights that grew large: finite, but past float16's range

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def tabular_data(bad_row: torch.Tensor | None = None, positive: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=g)
    x = x.abs() + 0.5 if positive else x
    if bad_row is not None:
        x[BAD_STEP * 8 + 3] = bad_row
    return DataLoader(TensorDataset(x, torch.randn(32, generator=g)), batch_size=8)


def _zero_count() -> torch.Tensor:
    row = torch.rand(16) + 0.5
    row[5] = 0.0  # a count of 0 among positive counts
    return row


_F = __file__
GPT = "user code: tiny GPT written from scratch"
TAB = "user code: tabular MLP with a hand-written norm"
ROWS = [
    Row("gpt_between", GPT, "NaN made in the LightningModule's own forward between blocks (`x * nan`)",
        lambda: (TinyGPT("between"), gpt_data()), "nonfinite_output", "mul", Marker("between-blocks"), _F),
    Row("gpt_temperature", GPT, "`h / temperature` in the LightningModule's forward, temperature annealed to 0",
        lambda: (TinyGPT(anneal=1.0), gpt_data()), "nonfinite_output", "div", Marker("temperature"), _F),
    Row("gpt_two_divs", GPT, "two call sites of `div`: attention's `/ math.sqrt(d)` fine, the MLP's 0/0 bad",
        lambda: (TinyGPT("mlp_zero"), gpt_data()), "nonfinite_output", "div",
        Marker("mlp-div", instance="blocks.1.mlp"), _F),
    Row("gpt_nan_weight", GPT, "a NaN weight under a causal mask (`masked_fill(mask, -inf)` is no culprit)",
        lambda: (TinyGPT("nan_weight"), gpt_data()), "nonfinite_param", None,
        Leaf(GPT_NAN_WEIGHT, "nan-weight"), _F),
    Row("gpt_hook_write", GPT, "a forward hook writes NaN into an output in place (`out[0, 0] = nan`)",
        lambda: (TinyGPT("hook"), gpt_data()), "nonfinite_output", "__setitem__",
        Marker("hook-write", hooked=GPT_HOOKED), _F),
    Row("gpt_attn_scale", GPT, "0/0 in attention scaling (config `attn_scale=0`)",
        lambda: (TinyGPT(attn_scale=0.0), gpt_data()), "nonfinite_output", "div",
        Marker("attn-scale", instance="blocks.0.attn"), _F),
    Row("gpt_masked_row", GPT, "softmax over a fully masked row (an all-padding sequence)",
        lambda: (TinyGPT(), gpt_data(fully_padded=True)), "nonfinite_output", "softmax",
        Marker("masked-row", instance="blocks.0.attn"), _F),
    Row("tab_zero_std", TAB, "zero std in a hand-written normalisation (a constant feature row)",
        lambda: (Tabular("std"), tabular_data(torch.full((16,), 0.3))), "nonfinite_output", "div",
        Marker("zero-std"), _F),
    Row("tab_sqrt_neg", TAB, "`sqrt(E[x²] − E[x]²)` of a constant row rounds below 0",
        lambda: (Tabular("var"), tabular_data(torch.full((16,), 0.1))), "nonfinite_output", "sqrt",
        Marker("sqrt-neg"), _F),
    Row("tab_log_zero", TAB, "`log` of a count of 0 in the LightningModule's forward",
        lambda: (Tabular(log_features=True), tabular_data(_zero_count(), positive=True)), "nonfinite_output",
        "log", Marker("log-zero"), _F),
    Row("tab_rms_sqrt0", TAB, "`sqrt(0)` in an RMS norm's backward (an all-zero feature row)",
        lambda: (Tabular("rms"), tabular_data(torch.zeros(16))), "nonfinite_grad", "SqrtBackward0",
        Marker("rms-sqrt"), _F),
    Row("tab_fp16_overflow", TAB, "fp16 overflow in an MLP (its first weight grew x1e5, still finite)",
        lambda: (Tabular(grow=1e5), tabular_data()), "nonfinite_output", "linear", Marker("fc1", child="fc1"),
        _F, trainer=fp16_autocast(), note="fp16 autocast on CPU (MixedPrecision plugin, GradScaler)"),
]  # fmt: skip
