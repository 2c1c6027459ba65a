"""Lightning's own examples (``pytorch_lightning.demos``): ``LightningTransformer`` (its ``Transformer`` builds
``-inf`` causal masks) on random tokens, and ``BoringModel`` on its ``RandomDataset``, subclassed the way their
docstrings suggest. Faults come in through the data, a weight, a hook or a hyperparameter, at ``BAD_STEP``."""

from __future__ import annotations

from typing import Any

import torch
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset
from pytorch_lightning.demos.transformer import LightningTransformer, Transformer
from torch import nn
from torch.utils.data import DataLoader

from instruments.diagnosis.real.harness import BAD_STEP, Leaf, Marker, Row

VOCAB = 50


class TinyTransformer(LightningTransformer):
    """The demo with a tiny ``Transformer`` (no dropout); ``fault`` picks what goes wrong at ``BAD_STEP``."""

    def __init__(self, fault: str = "") -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=32, nlayers=1, dropout=0.0)
        self.fault = fault

    def prepare_data(self) -> None:
        """Random tokens instead of the demo's WikiText2 download."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step != BAD_STEP or getattr(self, "_done", False):
            return
        self._done = True
        if self.fault == "nan_weight":
            with torch.no_grad():
                self.get_parameter(DEMO_NAN_WEIGHT)[0, 0] = float("nan")  # FAULT: nan-weight
        elif self.fault == "hook":
            self.get_submodule(DEMO_HOOKED).register_forward_hook(nan_hook)


DEMO_NAN_WEIGHT = "model.transformer.decoder.layers.0.self_attn.in_proj_weight"
DEMO_HOOKED = "model.transformer.encoder.layers.0.linear2"


def nan_hook(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
    """A debugging hook left in: it marks one activation by writing into the module's output in place."""
    out[0, 0] = float("nan")  # FAULT: hook-write


def token_pairs() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (16, 8), generator=g)
    return DataLoader(list(zip(x, torch.roll(x, -1, dims=1))), batch_size=4)


class TemperedBoring(BoringModel):
    """``BoringModel`` whose forward divides by a temperature a schedule brings to 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        temperature = max(0.0, 1.0 - self.global_step)
        return self.layer(x) / temperature  # FAULT: temperature


def random_data(poison: int | None = None) -> DataLoader:
    data = RandomDataset(32, 64)
    if poison is not None:
        data.data[poison, 3] = float("nan")  # FAULT: nan-batch
    return DataLoader(data, batch_size=8)


_F = __file__
TRANSFORMER = "Lightning demo: LightningTransformer"
BORING = "Lightning demo: BoringModel"
ROWS = [
    Row("demo_transformer_nan_weight", TRANSFORMER, "a NaN weight in the decoder's self-attention (-inf causal mask)",
        lambda: (TinyTransformer("nan_weight"), token_pairs()), "nonfinite_param", None,
        Leaf(DEMO_NAN_WEIGHT, "nan-weight"), _F),
    Row("demo_transformer_hook_write", TRANSFORMER, "a forward hook writes NaN into an encoder layer's `linear2`",
        lambda: (TinyTransformer("hook"), token_pairs()), "nonfinite_output", "__setitem__",
        Marker("hook-write", hooked=DEMO_HOOKED), _F),
    Row("boring_nan_batch", BORING, "a NaN in the batch (RandomDataset)",
        lambda: (BoringModel(), random_data(BAD_STEP * 8 + 2)), "nonfinite_input", None, Leaf("batch", "nan-batch"), _F),
    Row("boring_accumulation", BORING, "a NaN in the second micro-batch of step 1 (accumulation)",
        lambda: (BoringModel(), random_data(3 * 8 + 5)), "nonfinite_input", None, Leaf("batch", "nan-batch"), _F,
        trainer={"accumulate_grad_batches": 2}, note="accumulate_grad_batches=2", batch_idx=3),
    Row("boring_temperature", BORING, "`/ temperature` in the subclass's forward, temperature scheduled to 0",
        lambda: (TemperedBoring(), random_data()), "nonfinite_output", "div", Marker("temperature"), _F),
]  # fmt: skip
