"""A Lightning Fabric loop guarded by one line: ``Fabric(callbacks=[NumGuard()])``; the loop is left as it is.

The loop is shaped like LitGPT's ``pretrain`` (the learning rate set by hand each step, ``no_backward_sync``
accumulation, ``fabric.backward``, ``fabric.clip_gradients(max_norm=1.0)`` with its default
``error_if_nonfinite=True``, ``optimizer.step()``). Two faults: a NaN gradient in step 4's backward pass (unguarded,
``clip_gradients`` raises "The total norm ... is non-finite"), and a token id past the vocabulary in step 7's first
micro-batch, inside a ``torch.compile``d model (unguarded, the compiled kernel dies: "index out of bounds"). The
guard decides right after ``fabric.backward``, before the loop reads the gradients, rolls each step back, names the
culprit and the micro-batch, and the run goes on. Runs as written::

    python examples/fabric_loop.py          # 200 steps
    python examples/fabric_loop.py --fast   # 10 steps (the test suite runs this)

A LitGPT run needs no code at all: ``NUMGUARD=1 litgpt pretrain ...`` (or ``NUMGUARD_CONFIG=numguard.yaml``, e.g.
``examples/numguard.yaml``) puts the same guard into its ``Fabric`` through Fabric's callback entry points.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_numguard.fabric import NumGuard

VOCAB, ACCUMULATE = 64, 2
NAN_GRAD_STEP, BAD_TOKEN_STEP = 4, 7


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 32)
        self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.lm_head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        return self.lm_head(x + self.block(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="10 steps (the test suite's run)")
    parser.add_argument("--dir", default="numguard-examples/fabric", help="output folder")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    steps = 10 if args.fast else 200
    torch.manual_seed(0)

    guard = NumGuard(action="rollback", dirpath=args.dir, emit_warnings=False)  # the one line
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    net = TinyLM()
    model = fabric.setup(torch.compile(net, backend="eager"))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    step = {"now": 0}
    net.block[1].weight.register_hook(lambda g: g * float("nan") if step["now"] == NAN_GRAD_STEP else g)

    g = torch.Generator().manual_seed(1)
    for it in range(steps * ACCUMULATE):
        step["now"] = it // ACCUMULATE
        for group in optimizer.param_groups:  # the loop's own learning-rate schedule
            group["lr"] = 3e-3 * (1 - step["now"] / steps)
        tokens = torch.randint(0, VOCAB, (4, 17), generator=g)
        if it == BAD_TOKEN_STEP * ACCUMULATE:
            tokens[2, 0] = VOCAB + 3  # past the vocabulary (an input only: the targets start at position 1)
        accumulating = (it + 1) % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            fabric.backward(loss / ACCUMULATE)
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    guard.close()

    for event in guard.events:
        say = f"step {event['step']} micro-batch {event['batch_idx']}: {event['kind']} in {event['where']}"
        print(say + (f" ({event['module']})" if event.get("module") else "") + f" -> {event['action']}")
    print("counters:", guard.counters)
    print("weights finite:", all(bool(torch.isfinite(p).all()) for p in net.parameters()))


if __name__ == "__main__":
    main()
