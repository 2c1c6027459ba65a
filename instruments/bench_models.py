"""The benchmark models and their in-process data (nothing is downloaded).

Each model is a plain ``nn.Module`` wrapped in :class:`BenchModule`, a minimal LightningModule
(cross-entropy loss, AdamW, no ``self.log``), with a list of ready-made batches. Sizes were
chosen so that one training step takes tens of milliseconds on one core of the project's
shared 2-core CPU (see ``benchmarks/README.md``); ``--lm-size 100m`` builds a GPT-2-small-sized
language model (~134M parameters) for the CUDA run.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "BenchModule", "ModelSpec", "build"]

MODELS = ("mlp", "cnn", "lm", "deep")

# name -> (vocab, d_model, layers, heads, d_ff, seq_len on cpu, batch on cpu, seq_len on cuda, batch on cuda)
LM_SIZES: dict[str, tuple[int, int, int, int, int, int, int, int, int]] = {
    "small": (2048, 128, 2, 4, 512, 64, 8, 256, 32),
    "100m": (32000, 768, 12, 12, 3072, 32, 2, 512, 16),
}


class MLP(nn.Sequential):
    def __init__(self, d_in: int = 512, hidden: int = 768, classes: int = 10) -> None:
        super().__init__(
            nn.Linear(d_in, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )


def _conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class CNN(nn.Sequential):
    """A small VGG-style network with BatchNorm, for 32x32 RGB images."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__(
            _conv_block(3, 32),
            _conv_block(32, 32),
            nn.MaxPool2d(2),
            _conv_block(32, 64),
            _conv_block(64, 64),
            nn.MaxPool2d(2),
            _conv_block(64, 128),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, classes),
        )


class TinyLM(nn.Module):
    """Token embedding + learned positions + pre-norm causal ``TransformerEncoderLayer``s + LM head."""

    def __init__(
        self,
        vocab: int,
        d_model: int,
        layers: int,
        heads: int,
        d_ff: int,
        max_len: int,
        float_mask: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, d_ff, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        # A boolean mask (True = may not attend). NumGuard 0.x flags a float mask buffer holding
        # -inf as a non-finite buffer and refuses to start (see benchmarks/README.md).
        mask = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)
        if float_mask:  # the other common form: 0 where allowed, -inf where masked
            mask = torch.zeros(max_len, max_len).masked_fill(mask, float("-inf"))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class _Block(nn.Module):
    """Pre-norm residual MLP block: six modules."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


class DeepNet(nn.Module):
    """A deep residual MLP of ``depth`` blocks: more than 500 modules (``6 * depth + 4``)."""

    def __init__(self, d_in: int = 64, width: int = 64, depth: int = 96, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class BenchModule(pl.LightningModule):
    """``training_step`` = cross-entropy of ``net(x)`` against ``y``; fused AdamW. Nothing is logged."""

    def __init__(self, net: nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.net = net
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        if out.dim() == 3:  # language model: (B, T, V) logits against (B, T) next tokens
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
        return F.cross_entropy(out, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # fused for every variant: the same optimizer everywhere, and the one `sync_mode="deferred"` needs
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01, fused=True)


@dataclass
class ModelSpec:
    name: str
    module: BenchModule
    init_state: dict[str, torch.Tensor]  # CPU copy of the initial weights; every run starts from it
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    n_params: int
    description: str

    def reset(self) -> None:
        """Put the initial weights (and BatchNorm statistics) back, bitwise."""
        self.module.load_state_dict(self.init_state, strict=True)


class BatchList(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Ready-made batches; used with ``DataLoader(batch_size=None)``."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        return self.batches[i]


def _lm_batches(vocab: int, seq: int, batch: int, n: int, g: torch.Generator) -> list[Any]:
    # A learnable stream: each token is a fixed function of the previous one, plus 10% noise.
    step = int(torch.randint(1, vocab, (1,), generator=g))
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        seqs = (start + step * torch.arange(seq + 1)) % vocab
        noise = torch.rand(seqs.shape, generator=g) < 0.1
        seqs = torch.where(noise, torch.randint(0, vocab, seqs.shape, generator=g), seqs)
        out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
    return out


def build(
    name: str,
    n_batches: int,
    device: str = "cpu",
    lm_size: str = "small",
    seed: int = 0,
    float_mask: bool = False,
) -> ModelSpec:
    """The model called ``name`` (``mlp``, ``cnn``, ``deep`` or ``lm``) with ``n_batches`` batches of data."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "mlp":
        d_in, batch = 512, 128
        net: nn.Module = MLP(d_in)
        w = torch.randn(d_in, 10, generator=g)
        batches = []
        for _ in range(n_batches):
            x = torch.randn(batch, d_in, generator=g)
            batches.append((x, (x @ w).argmax(1)))
        desc = f"MLP 512-768-768-768-10 (GELU), batch {batch}"
    elif name == "cnn":
        batch = 12
        net = CNN()
        batches = []
        for _ in range(n_batches):
            x = torch.randn(batch, 3, 32, 32, generator=g)
            batches.append((x, (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0].mean(dim=(1, 2)) > 0).long()))
        desc = f"CNN 5x(conv3x3+BatchNorm+ReLU) 32-32-64-64-128, 32x32x3 images, batch {batch}"
    elif name == "deep":
        d_in, batch = 64, 64
        net = DeepNet(d_in)
        w = torch.randn(d_in, 10, generator=g)
        batches = []
        for _ in range(n_batches):
            x = torch.randn(batch, d_in, generator=g)
            batches.append((x, (x @ w).argmax(1)))
        n_modules = sum(1 for _ in net.modules())
        desc = f"deep residual MLP, 96 LayerNorm-Linear-GELU-Linear blocks, width 64, {n_modules} modules"
        desc += f", batch {batch}"
    elif name == "lm":
        if lm_size not in LM_SIZES:
            raise ValueError(f"--lm-size must be one of {list(LM_SIZES)}, got {lm_size!r}")
        vocab, d, layers, heads, d_ff, seq_cpu, b_cpu, seq_gpu, b_gpu = LM_SIZES[lm_size]
        seq, batch = (seq_gpu, b_gpu) if device == "cuda" else (seq_cpu, b_cpu)
        net = TinyLM(vocab, d, layers, heads, d_ff, max_len=max(seq_cpu, seq_gpu), float_mask=float_mask)
        batches = _lm_batches(vocab, seq, batch, n_batches, g)
        desc = (
            f"transformer LM ({lm_size}): vocab {vocab}, d_model {d}, {layers} layers, {heads} heads, "
            f"d_ff {d_ff}, seq {seq}, batch {batch}" + (", float -inf causal-mask buffer" if float_mask else "")
        )
    else:
        raise ValueError(f"unknown model {name!r}; choose from {list(MODELS)}")
    lr = 3e-4 if name == "lm" else 1e-3
    module = BenchModule(net, lr=lr)
    init_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    n_params = sum(p.numel() for p in module.parameters())
    return ModelSpec(name, module, init_state, batches, n_params, f"{desc}; {_fmt_params(n_params)} params")


def _fmt_params(n: int) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.0f}k"


def dataloader(spec: ModelSpec) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(BatchList(spec.batches), batch_size=None, shuffle=False, num_workers=0)


def lm_tokens_per_step(spec: ModelSpec) -> int:
    x, _ = spec.batches[0]
    return int(math.prod(x.shape))


def quiet() -> None:
    """Silence Lightning's info logs and the warnings every benchmark fit would repeat."""
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=r".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", message=r".*Tensor Cores.*")
    warnings.filterwarnings("ignore", message=r".*anomaly detection.*")


def bench_trainer(root: str, steps: int, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    """A one-device ``Trainer`` that runs ``steps`` training steps and nothing else: no logger, checkpoint, progress
    bar, summary or validation (``kwargs`` override, e.g. ``accelerator`` and ``precision``)."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": root,
        "callbacks": callbacks,
    }
    return pl.Trainer(**(options | kwargs))
