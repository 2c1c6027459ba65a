"""A tiny LitGPT pretraining set-up the tests write themselves: a random ``Config``, a ``DataModule`` of token ids,
and an AdamW that leaves a NaN in one weight after a chosen step (the faults of issue 32).

Imported by ``litgpt_script.py`` in a subprocess (LitGPT reads the optimizer's ``class_path`` and the data module
from here); nothing in it changes LitGPT.
"""

from __future__ import annotations

from typing import Any

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader

VOCAB = 128
BLOCK = 16
MICRO = 2


def tiny_config() -> Any:
    from litgpt import Config

    return Config(
        name="tiny-gpt",
        block_size=BLOCK,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=1,
        n_head=2,
        n_embd=16,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=32,
    )


class TokenData(DataModule):
    """``n`` random sequences of ``BLOCK + 1`` token ids; batch ``bad_batch`` (0-based) holds the id ``bad_id`` at
    its first position (an input only: the targets start at the second position)."""

    def __init__(self, n: int = 64, bad_batch: int | None = None, bad_id: int = VOCAB + 2, seed: int = 0) -> None:
        super().__init__()
        self.n, self.bad_batch, self.bad_id, self.seed = n, bad_batch, bad_id, seed
        self.batch_size = MICRO

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None, **kw: Any) -> None:
        self.batch_size = batch_size

    def _tokens(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, VOCAB, (self.n, BLOCK + 1), generator=g)

    def train_dataloader(self) -> DataLoader:
        data = self._tokens(self.seed)
        if self.bad_batch is not None:
            data[self.bad_batch * self.batch_size, 0] = self.bad_id
        return DataLoader(list(data), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(list(self._tokens(self.seed + 1)[:8]), batch_size=self.batch_size, shuffle=False)


class NaNAfterStep(torch.optim.AdamW):
    """AdamW that writes NaN into one element of its first parameter right after its ``nan_after``-th step (the
    weight the optimizer left non-finite); ``nan_after=0``: never."""

    def __init__(self, params: Any, lr: float = 1e-3, nan_after: int = 0, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, **kwargs)
        self.nan_after = nan_after
        self.calls = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        self.calls += 1
        if self.calls == self.nan_after:
            self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out
