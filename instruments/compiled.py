"""What the guard adds to a ``torch.compile``d model, counted by inductor and dynamo themselves.

    python -m benchmarks.compiled [--blocks 2,8,32] [--steps 20] [--modes forward,module] [--device cpu]
                                  [--write docs/performance.md]

A residual MLP of pre-LayerNorm blocks (:class:`Residual`) is trained by a LightningModule whose ``forward`` calls a
``torch.compile``d function (``forward``) or that is handed to the Trainer as ``torch.compile(module)`` (``module``),
once without the guard and once with ``NumGuardCallback()`` defaults, from the same seed. After step 1, 2 and
``--steps`` it reads inductor's own count of the kernels it generated (``torch._inductor.metrics.
generated_kernel_count``, forward and backward graphs) and dynamo's counts of graphs compiled and graph breaks
(``torch._dynamo.utils.counters``). Inductor's graph caches are off for the count (a hit generates no kernel). On
the CPU inductor's count is of loop nests (the C++ backend counts each one, a kernel function may hold several); on
CUDA it is of Triton kernels.

Counts, not times: they do not move with the machine's load, and ``tests/doors/trainer/test_compiled.py`` asserts
them. ``--write FILE`` replaces the table between ``<!-- compiled -->`` and ``<!-- /compiled -->`` in ``FILE``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback
from torch import nn

from instruments.bench_models import quiet
from instruments.markdown import replace_block
from lightning_numguard.callbacks import NumGuardCallback

__all__ = ["CompileCounts", "CompiledMLP", "Residual", "compile_counts", "main", "table"]

WIDTH, D_IN, CLASSES, BATCH = 32, 16, 4, 8


class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Residual(nn.Module):
    """An input projection, ``blocks`` pre-LayerNorm residual blocks, a final norm and a head."""

    def __init__(self, blocks: int, width: int = WIDTH) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CompiledMLP(pl.LightningModule):
    """:class:`Residual` trained with a fused AdamW (the deferred read's skip needs it); ``compile_forward``: its
    forward calls a ``torch.compile``d function (the hooks of the blocks run inside the compiled region, the
    LightningModule's own call outside)."""

    def __init__(self, blocks: int, compile_forward: bool = True, dynamic: bool | None = None) -> None:
        super().__init__()
        self.net = Residual(blocks)
        self.compiled = torch.compile(self.run_net, dynamic=dynamic) if compile_forward else None

    def run_net(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compiled(x) if self.compiled is not None else self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def batches(steps: int, batch: int = BATCH, last: int | None = None, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """``steps`` batches of inputs and labels; ``last``: the final batch's size, when it differs."""
    g = torch.Generator().manual_seed(seed)
    sizes = [batch] * steps if last is None else [batch] * (steps - 1) + [last]
    return [(torch.randn(n, D_IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)) for n in sizes]


@dataclass
class CompileCounts:
    """Inductor's kernels and dynamo's graphs and graph breaks, read after the steps in ``at``."""

    kernels: dict[int, int] = field(default_factory=dict)
    graphs: dict[int, int] = field(default_factory=dict)
    breaks: dict[int, int] = field(default_factory=dict)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the trained weights, for a bitwise comparison
    events: list[dict[str, Any]] = field(default_factory=list)  # the guard's events (none: no guard)


class _Reader(Callback):
    """Reads the counters at the end of the steps in ``at`` (the last callback: after the guard's own work)."""

    def __init__(self, counts: CompileCounts, at: tuple[int, ...]) -> None:
        self.counts, self.at = counts, at

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        step = trainer.global_step
        if step in self.at:
            from torch._dynamo.utils import counters
            from torch._inductor import metrics

            self.counts.kernels[step] = metrics.generated_kernel_count
            self.counts.graphs[step] = counters["stats"]["unique_graphs"]
            self.counts.breaks[step] = sum(counters["graph_break"].values())


@contextlib.contextmanager
def fresh_compiler() -> Iterator[None]:
    """Dynamo reset and its counters cleared, inductor's kernel count at 0 and its caches off, for one fit."""
    import torch._dynamo
    import torch._functorch.config
    from torch._inductor import config, metrics

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    metrics.reset()
    # the graph caches off (a hit generates no kernel); the compiled C++/Triton code cache stays on (a hit there still
    # counts the kernel: it is generated, then found built)
    with config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def compile_counts(
    blocks: int,
    guard: bool,
    steps: int = 20,
    at: tuple[int, ...] = (1, 2),
    mode: str = "forward",
    dynamic: bool | None = None,
    data: list[tuple[torch.Tensor, ...]] | None = None,
    device: str = "cpu",
    module: pl.LightningModule | None = None,
    guard_kwargs: dict[str, Any] | None = None,
) -> CompileCounts:
    """One fit of ``steps`` steps of a :class:`CompiledMLP` of ``blocks`` blocks (``module``: this one instead),
    without or with the guard; the counts after each step of ``at`` and after the last.

    ``mode``: ``"forward"`` (a compiled function inside the LightningModule) or ``"module"``
    (``trainer.fit(torch.compile(module))``).
    """
    quiet()
    counts = CompileCounts()
    torch.manual_seed(1234)
    if module is None:
        module = CompiledMLP(blocks, compile_forward=mode == "forward", dynamic=dynamic)
    fitted: Any = torch.compile(module, dynamic=dynamic) if mode == "module" else module
    data = data if data is not None else batches(steps)
    with tempfile.TemporaryDirectory(prefix="numguard-compiled-") as tmp, fresh_compiler():
        guards = [NumGuardCallback(dirpath=str(Path(tmp) / "ng"), **(guard_kwargs or {}))] if guard else []
        trainer = pl.Trainer(
            default_root_dir=tmp,
            accelerator=device,
            devices=1,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[*guards, _Reader(counts, (*at, steps))],
        )
        trainer.fit(fitted, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        if guards:
            counts.events = list(guards[0].events)
    counts.state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return counts


def extra_per_graph(plain: CompileCounts, guarded: CompileCounts, step: int) -> float:
    """The guard's inductor kernels per graph compiled, after ``step`` steps."""
    return (guarded.kernels[step] - plain.kernels[step]) / max(guarded.graphs[step], 1)


def table(blocks: list[int], modes: list[str], steps: int, device: str = "cpu") -> str:
    """The markdown table: kernels and graphs, plain and guarded, per model size and compiled form."""
    head = (
        "| blocks | compiled | plain: kernels after step 1 / 2 / "
        f"{steps}, graphs | guard: kernels after step 1 / 2 / {steps}, graphs | graph breaks | "
        "guard's kernels per graph |\n|---:|---|---|---|---:|---:|\n"
    )
    rows = []
    for mode in modes:
        for n in blocks:
            plain = compile_counts(n, False, steps, mode=mode, device=device)
            guarded = compile_counts(n, True, steps, mode=mode, device=device)

            def cell(c: CompileCounts) -> str:
                return f"{c.kernels[1]} / {c.kernels[2]} / {c.kernels[steps]}, {c.graphs[steps]}"

            breaks = f"{plain.breaks[steps]} / {guarded.breaks[steps]}"
            form = "forward" if mode == "forward" else "`torch.compile(module)`"
            rows.append(
                f"| {n} | {form} | {cell(plain)} | {cell(guarded)} | {breaks} | "
                f"{extra_per_graph(plain, guarded, steps):+g} |"
            )
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="2,8,32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default="forward,module")
    p.add_argument("--device", default="cpu", help="the Trainer's accelerator (cpu, cuda)")
    p.add_argument("--write", default=None, help="replace the table between the compiled markers in this file")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = table([int(b) for b in args.blocks.split(",")], args.modes.split(","), args.steps, args.device)
    print(out)
    if args.write:
        replace_block(args.write, "compiled", out)
    if args.out:
        Path(args.out).write_text(out, encoding="utf-8")


if __name__ == "__main__":
    main()
