"""False and caught spikes of the shipped spike detector on real clients: the table of ``docs/reference.md#spikes``.

Each client is a small-batch run trained with AdamW under a linear warm-up and a cosine decay, in a plain torch loop
that records each step's loss and global gradient norm (before any clipping): Hugging Face GPT-2, Llama and BERT from
tiny random configs (built from their config with no download; ``hf-gpt2-64`` is the run of issue 33, a GPT-2 of
width 64 at a batch of 2 whose gradient norm made the statistics before it skip a clean step), Lightning's demo
``Transformer`` and its ``BoringModel`` layer, a small MLP on a Gaussian mixture, a CNN with BatchNorm on shifted
image templates, and an LSTM language model. The recorded series are then scored by the guard's own
:class:`~lightning_numguard.detect.spike_guard.SpikeGuard` (the class the callback keeps, with the callback's
refresh interval, default sigma and default warm-up), one step at a time, exactly as a fit does: ``extras`` of the
step's raw ``[loss, grad_norm]`` on the device, the host read of them, ``findings``, then ``push``. Every spike of a
clean run is a false one.

Caught spikes: at step ``FAULT_AT`` of each client's run (after its warm-up) the training state is forked three times:

* ``batch x1000``: one batch whose loss is 1000 times larger (targets or sample weights 1000x); caught if flagged
  at that step;
* ``grad x1000``: one step whose gradients are 1000 times larger, the loss as it was (a gradient hook gone wrong);
  caught if flagged at that step;
* ``lr x100``: the learning rate multiplied by 100 for 3 steps; the first step flagged, if any within ``AFTER``
  steps (the loss and the gradient norm of a step show the update of the step before).

Usage::

    python -m benchmarks.spike_table                  # record (about 15 minutes on one core), score, print
    python -m benchmarks.spike_table --write          # ... and write the table into docs/reference.md
    python -m benchmarks.spike_table --steps 400      # a quick look
    python -m benchmarks.spike_table --save runs.pt   # keep the recorded series; --load runs.pt scores them again

The suite recomputes the BoringModel's row whole and the first few hundred steps of both GPT-2 clients
(``tests/doors/trainer/test_spike_table.py``).
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
from lightning_numguard.detect import spike
from lightning_numguard.detect.spike_guard import SpikeGuard

VOCAB, SEQ = 128, 16
WINDOW, SIGMA = SpikeConfig().window, SpikeConfig().sigma  # the callback's defaults
FAULT_AT = 300
#: The seed of ``hf-gpt2-64``: the one, among the first 200, whose clean gradient norm at step 85 scored 11.0 under
#: the statistics before issue 33 (median and upper-half MAD), a false spike at sigma 10.
GPT2_64_SEED = 126
AFTER = 8  # steps recorded from the fault on
DOC = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
BEGIN, END = "<!-- spike-table:begin -->", "<!-- spike-table:end -->"


@dataclass
class Client:
    """One small-batch training run: its model, loss, data, batch, peak learning rate and seed."""

    name: str
    batch: int
    lr: float
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    data: Callable[[torch.Generator, int], Any]
    seed: int = 0


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
    if kind in ("gpt2", "gpt2-64"):
        width = 64 if kind == "gpt2-64" else 32
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=width, n_layer=2, n_head=2))
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


#: Ten overlapping classes in 20 dimensions (the MLP's data: its loss stays well above zero).
_CENTERS = 0.6 * torch.randn(10, 20, generator=torch.Generator().manual_seed(11))
#: Ten smooth 20x20 templates (the CNN's data: a 16x16 crop of one, at a random shift, plus noise).
_TEMPLATES = nn.functional.avg_pool2d(torch.randn(10, 1, 20, 20, generator=torch.Generator().manual_seed(12)), 5, 1, 2)


def _mixture(g: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, 10, (batch,), generator=g)
    return _CENTERS[y] + torch.randn(batch, 20, generator=g), y


def _images(g: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, 10, (batch,), generator=g)
    dx, dy = torch.randint(0, 5, (2,), generator=g).tolist()
    x = 3.0 * _TEMPLATES[y, :, dy : dy + 16, dx : dx + 16] + 0.5 * torch.randn(batch, 1, 16, 16, generator=g)
    return x, y


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def _classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


class LSTMLanguageModel(nn.Module):
    """An embedding, one LSTM layer and a head: a tiny recurrent language model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.rnn = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


def _next_token(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


CLIENTS: dict[str, Client] = {
    "hf-gpt2-64": Client("hf-gpt2-64", 2, 1e-2, lambda: _hf("gpt2-64"), _causal, markov_tokens, seed=GPT2_64_SEED),
    "mlp": Client("mlp", 4, 3e-3, _mlp, _classify, _mixture),
    "cnn": Client("cnn", 4, 3e-3, _cnn, _classify, _images),
    "lstm-lm": Client("lstm-lm", 2, 3e-3, LSTMLanguageModel, _next_token, markov_tokens),
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


def _step(
    model: nn.Module, client: Client, opt: Any, sched: Any, x: Any, scale: float = 1.0, grad_scale: float = 1.0
) -> tuple[float, float]:
    opt.zero_grad(set_to_none=True)
    loss = client.loss(model, x) * scale
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grad_scale != 1.0:
        torch._foreach_mul_(grads, grad_scale)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    opt.step()
    sched.step()
    return float(loss.detach()), float(norm)


#: The faults forked at :data:`FAULT_AT`, in the table's order.
FAULTS = ("batch x1000", "grad x1000", "lr x100")


def record(client: Client, steps: int, seed: int | None = None, planned: int | None = None) -> dict[str, Any]:
    """The clean series of ``steps`` steps and the fault forks (:data:`FAULTS`) at :data:`FAULT_AT` (when the run
    reaches it); ``seed``: the client's own by default; ``planned``: the steps the schedule is laid out for (default
    ``steps``)."""
    seed = client.seed if seed is None else seed
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
        for fault in FAULTS:
            # a fresh copy each time: load_state_dict keeps the optimizer's state tensors by reference, and the
            # fault's steps would change them in place for the next fault
            state = copy.deepcopy(fork)
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
            sched.load_state_dict(state[2])
            g.set_state(state[3])
            torch.set_rng_state(state[4])  # dropout: the faults do not depend on how long the clean run went on
            out = []
            for i in range(AFTER):
                if fault == "lr x100" and i < 3:  # the schedule sets each step's rate afresh: x100 on top, 3 steps
                    for group in opt.param_groups:
                        group["lr"] *= 100.0
                scale = 1000.0 if fault == "batch x1000" and i == 0 else 1.0
                grad_scale = 1000.0 if fault == "grad x1000" and i == 0 else 1.0
                out.append(_step(model, client, opt, sched, client.data(g, client.batch), scale, grad_scale))
            faults[fault] = out
    return {"series": series, "faults": faults}


#: Every how many steps, from :data:`FAULT_AT` on, the sweep scales a clean step by 1000.
SWEEP_EVERY = 5


@dataclass
class Judged:
    """What the shipped detector made of a series."""

    flagged: list[int]  # the steps it flags (from ``start`` on)
    top: float | None  # the largest z-score of either series (from ``start`` on; None: nothing judged)
    swept: int  # steps of the sweep: every SWEEP_EVERY-th from FAULT_AT on
    caught: int  # of which, scaled by 1000 (loss and gradient norm), the detector would have flagged


def judged(series: list[tuple[float, float]], start: int = 0, sigma: float = SIGMA) -> Judged:
    """What the callback's own :class:`SpikeGuard` with its defaults (``sigma`` apart) makes of ``series``, fed one
    step at a time as a fit feeds it (``extras`` on the device, the host read of them, ``findings``, ``push``).

    The sweep asks, at every :data:`SWEEP_EVERY`-th step from :data:`FAULT_AT` on, whether a batch 1000x there (its
    loss and so its gradient norm 1000x) would have been flagged: the window does not hold the step it judges, so
    the same step's statistics, read from the same extras, answer exactly.
    """
    guard = SpikeGuard("warn", sigma, WINDOW, min(WINDOW // 2, DEFAULT_SPIKE_WARMUP), 0, None)
    device = torch.device("cpu")
    out = Judged([], None, 0, 0)
    for i, (loss, norm) in enumerate(series):
        extras = torch.stack(guard.extras(torch.tensor(loss), torch.tensor(norm), None, device))
        guard.reduced = extras
        values = extras.tolist()
        spikes, _ = guard.findings(values, i, None)
        if i >= start:
            if spikes:
                out.flagged.append(i)
            for z in spike.scores(values, sigma):
                if z is not None and (out.top is None or z > out.top):
                    out.top = z
        if i >= FAULT_AT and (i - FAULT_AT) % SWEEP_EVERY == 0:
            out.swept += 1
            out.caught += bool(spike.judge([loss * 1000.0, norm * 1000.0, *values[2:]], sigma))
        guard.push()
    return out


def flagged(series: list[tuple[float, float]], start: int = 0, sigma: float = SIGMA) -> list[int]:
    """The steps (indices of ``series``, from ``start`` on) the shipped detector flags (:func:`judged`)."""
    return judged(series, start, sigma).flagged


def score(name: str, recorded: dict[str, Any], sigma: float = SIGMA) -> dict[str, Any]:
    """A client's row: its false spikes, its largest clean z-score, where each fault was caught and the sweep."""
    series = recorded["series"]
    row: dict[str, Any] = {"client": name, "batch": CLIENTS[name].batch, "steps": len(series)}
    clean = judged(series, sigma=sigma)
    row["false"] = len(clean.flagged)
    row["top"] = "-" if clean.top is None else f"{clean.top:.1f}"
    row["sweep"] = f"{clean.caught}/{clean.swept}" if clean.swept else "-"
    for fault, values in recorded["faults"].items():
        hits = flagged(series[:FAULT_AT] + values, start=FAULT_AT, sigma=sigma)
        row[fault] = f"step +{hits[0] - FAULT_AT}" if hits else f"not within {len(values)} steps"
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The published table: a row per client, then the totals."""
    lines = [
        "| client | batch | clean steps | false spikes | largest clean z | batch x1000 caught at "
        "| grad x1000 caught at | lr x100 (3 steps) caught at | a batch x1000 caught, swept |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        caught = " | ".join(str(r.get(fault, "-")) for fault in FAULTS)
        lines.append(
            f"| {r['client']} | {r['batch']} | {r['steps']} | {r['false']} | {r['top']} | {caught} | {r['sweep']} |"
        )
    total = sum(r["steps"] for r in rows)
    false = sum(r["false"] for r in rows)
    lines.append(f"| **all** | | **{total}** | **{false}** | | | | | |")
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
    parser.add_argument("--sigma", type=float, default=SIGMA, help="score at this sigma (default: the callback's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows, saved = [], torch.load(args.load) if args.load else {}
    for name in args.clients.split(","):
        began = time.perf_counter()
        recorded = saved[name] if args.load else record(CLIENTS[name], args.steps)
        saved[name] = recorded
        rows.append(score(name, recorded, args.sigma))
        print(f"{name}: {rows[-1]} ({time.perf_counter() - began:.0f} s)", flush=True)
    if args.save:
        torch.save(saved, args.save)
    text = table(rows)
    print(text)
    print(f"wall time: {time.perf_counter() - started:.0f} s", flush=True)
    if args.write:
        if args.sigma != SIGMA:
            parser.error("--write publishes the default sigma's table")
        write(text)


if __name__ == "__main__":
    main()
