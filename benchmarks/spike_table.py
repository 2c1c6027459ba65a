"""False and caught spikes of the shipped spike detector on real clients: the table of ``docs/reference.md#spikes``.

Each client is a real model (Hugging Face GPT-2, Llama and BERT from tiny random configs, built from their config
with no download; Lightning's demo ``Transformer``, and its ``BoringModel`` layer) trained with AdamW at a small
batch, under a linear warm-up and a cosine decay, in a plain torch loop that records each step's loss and global
gradient norm (before any clipping). The recorded series are then scored by the guard's own
:class:`~lightning_numguard.detect.spike.SpikeWindow` (the class the callback keeps on the device, with the
callback's refresh interval, default sigma and default warm-up), one step at a time, exactly as a fit does:
``scores`` of the step's raw ``[loss, grad_norm]`` against the window, then ``push``. Every spike of a clean run is
a false one.

Caught spikes: at step ``FAULT_AT`` of each client's run (after its warm-up) the training state is forked twice:

* ``lr x100``: the learning rate multiplied by 100 for 3 steps; caught if a spike is flagged at the first step
  or the one after it (the loss and the gradient norm of a step show the update of the step before);
* ``batch x1000``: one batch whose loss is 1000 times larger (targets or sample weights 1000x); caught if flagged
  at that step.

Usage::

    python -m benchmarks.spike_table                  # record (a few minutes on one core), score, print
    python -m benchmarks.spike_table --write          # ... and write the table into docs/reference.md
    python -m benchmarks.spike_table --steps 400      # a quick look

The suite runs one client for a few hundred steps (``tests/doors/trainer/test_spike_table.py``).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_numguard import SpikeConfig
from lightning_numguard.config.validate import DEFAULT_SPIKE_WARMUP
from lightning_numguard.detect.spike_guard import SpikeGuard

VOCAB, SEQ = 128, 16
WINDOW, SIGMA = SpikeConfig().window, SpikeConfig().sigma  # the callback's defaults
FAULT_AT = 300
AFTER = 8  # steps recorded from the fault on
DOC = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
BEGIN, END = "<!-- spike-table:begin -->", "<!-- spike-table:end -->"


@dataclass
class Client:
    name: str
    batch: int
    lr: float
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    data: Callable[[torch.Generator, int], Any]


def markov_tokens(g: torch.Generator, batch: int) -> torch.Tensor:
    """Token sequences of a fixed random bigram language (learnable, with the noise of real text at small batches)."""
    rows = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(7)), dim=-1)
    out = torch.empty(batch, SEQ, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for t in range(1, SEQ):
        out[:, t] = torch.multinomial(rows[out[:, t - 1]], 1, generator=g).squeeze(-1)
    return out


def _hf(kind: str) -> nn.Module:
    import transformers as tf

    small = {"vocab_size": VOCAB, "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 32}
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    if kind == "llama":
        config = tf.LlamaConfig(intermediate_size=64, num_key_value_heads=2, max_position_embeddings=SEQ, **small)
        return tf.LlamaForCausalLM(config)
    return tf.BertForMaskedLM(tf.BertConfig(intermediate_size=64, max_position_embeddings=SEQ, **small))


def _causal(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def _masked(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(x.sum()))
    chosen = torch.rand(x.shape, generator=g) < 0.15
    chosen[:, 0] = True  # at least one prediction per sequence
    labels = torch.where(chosen, x, -100)
    return model(input_ids=torch.where(chosen, 0, x), labels=labels).loss


def _demo_transformer() -> nn.Module:
    from pytorch_lightning.demos.transformer import Transformer

    return Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.1)


def _demo_transformer_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x[:, :-1], x[:, 1:])
    return nn.functional.nll_loss(out, x[:, 1:].reshape(-1))


def _boring() -> nn.Module:
    from pytorch_lightning.demos.boring_classes import BoringModel

    return BoringModel()


def _boring_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.loss(model(x))  # BoringModel's own step: MSE of its layer's output against ones


def _gaussian(g: torch.Generator, batch: int) -> torch.Tensor:
    return torch.randn(batch, 32, generator=g)  # BoringModel's RandomDataset


CLIENTS: dict[str, Client] = {
    "hf-gpt2": Client("hf-gpt2", 4, 1e-3, lambda: _hf("gpt2"), _causal, markov_tokens),
    "hf-llama": Client("hf-llama", 4, 1e-3, lambda: _hf("llama"), _causal, markov_tokens),
    "hf-bert": Client("hf-bert", 8, 1e-3, lambda: _hf("bert"), _masked, markov_tokens),
    "pl-demo-transformer": Client(
        "pl-demo-transformer", 4, 1e-3, _demo_transformer, _demo_transformer_loss, markov_tokens
    ),
    "pl-boring-model": Client("pl-boring-model", 2, 1e-2, _boring, _boring_loss, _gaussian),
}


def schedule(steps: int, warmup: int = 100) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to 10 %."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _step(model: nn.Module, client: Client, opt: Any, sched: Any, x: Any, scale: float = 1.0) -> tuple[float, float]:
    opt.zero_grad(set_to_none=True)
    loss = client.loss(model, x) * scale
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    opt.step()
    sched.step()
    return float(loss.detach()), float(norm)


def record(client: Client, steps: int, seed: int = 0, planned: int | None = None) -> dict[str, Any]:
    """The clean series of ``steps`` steps and the two fault forks at :data:`FAULT_AT` (when the run reaches it);
    ``planned``: the steps the schedule is laid out for (default ``steps``)."""
    torch.manual_seed(seed)
    model = client.build()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=client.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(planned or steps))
    g = torch.Generator().manual_seed(seed + 1)
    series: list[tuple[float, float]] = []
    fork = None
    for step in range(steps):
        if step == FAULT_AT:
            fork = copy.deepcopy(
                (model.state_dict(), opt.state_dict(), sched.state_dict(), g.get_state(), torch.get_rng_state())
            )
        series.append(_step(model, client, opt, sched, client.data(g, client.batch)))
    faults: dict[str, list[tuple[float, float]]] = {}
    if fork is not None:
        for fault in ("lr x100", "batch x1000"):
            model.load_state_dict(fork[0])
            opt.load_state_dict(fork[1])
            sched.load_state_dict(fork[2])
            g.set_state(fork[3])
            torch.set_rng_state(fork[4])  # dropout: the faults do not depend on how long the clean run went on
            out = []
            for i in range(AFTER):
                if fault == "lr x100" and i < 3:  # the schedule sets each step's rate afresh: x100 on top, 3 steps
                    for group in opt.param_groups:
                        group["lr"] *= 100.0
                scale = 1000.0 if fault == "batch x1000" and i == 0 else 1.0
                out.append(_step(model, client, opt, sched, client.data(g, client.batch), scale))
            faults[fault] = out
    return {"series": series, "faults": faults}


def flagged(series: list[tuple[float, float]], start: int = 0) -> list[int]:
    """The steps (indices of ``series``, from ``start`` on) the shipped detector flags: the callback's own
    :class:`SpikeGuard` with its defaults, fed one step at a time as a fit feeds it (``extras`` on the device, the
    host read of them, ``findings``, ``push``)."""
    guard = SpikeGuard("warn", SIGMA, WINDOW, min(WINDOW // 2, DEFAULT_SPIKE_WARMUP), 0, None)
    device = torch.device("cpu")
    out = []
    for i, (loss, norm) in enumerate(series):
        extras = torch.stack(guard.extras(torch.tensor(loss), torch.tensor(norm), None, device))
        guard.reduced = extras
        spikes, _ = guard.findings(extras.tolist(), i, None)
        if i >= start and spikes:
            out.append(i)
        guard.push()
    return out


def score(name: str, recorded: dict[str, Any]) -> dict[str, Any]:
    series = recorded["series"]
    row: dict[str, Any] = {"client": name, "batch": CLIENTS[name].batch, "steps": len(series)}
    row["false"] = len(flagged(series))
    for fault, values in recorded["faults"].items():
        hits = flagged(series[:FAULT_AT] + values, start=FAULT_AT)
        row[fault] = f"step +{hits[0] - FAULT_AT}" if hits else f"not within {len(values)} steps"
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| client | batch | clean steps | false spikes | batch x1000 caught at | lr x100 (3 steps) caught at |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        caught = f"{r.get('batch x1000', '-')} | {r.get('lr x100', '-')}"
        lines.append(f"| {r['client']} | {r['batch']} | {r['steps']} | {r['false']} | {caught} |")
    total = sum(r["steps"] for r in rows)
    false = sum(r["false"] for r in rows)
    lines.append(f"| **all** | | **{total}** | **{false}** | | |")
    return "\n".join(lines)


def write(text: str) -> None:
    doc = DOC.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--write", action="store_true", help="write the table into docs/reference.md")
    parser.add_argument("--save", type=Path, help="save the recorded series (torch.save) here")
    parser.add_argument("--load", type=Path, help="score series saved by --save instead of recording")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, saved = [], torch.load(args.load) if args.load else {}
    for name in args.clients.split(","):
        began = time.perf_counter()
        recorded = saved[name] if args.load else record(CLIENTS[name], args.steps)
        saved[name] = recorded
        rows.append(score(name, recorded))
        print(f"{name}: {rows[-1]} ({time.perf_counter() - began:.0f} s)", flush=True)
    if args.save:
        torch.save(saved, args.save)
    text = table(rows)
    print(text)
    if args.write:
        write(text)


if __name__ == "__main__":
    main()
