"""A plain PyTorch loop guarded in two lines: ``from lightning_numguard import attach``; ``attach(models, optimizers)``.

The seeds' RCAN story, as its author wrote the loop: a super-resolution network (modelA, with RCAN's fixed
``MeanShift`` layer handed to ``optim.Adam(netG.parameters())`` all the same), a second network ending in a sigmoid
(modelB), ``nn.BCELoss`` on modelB's output. After a while an upstream NaN (here: one corrupted pixel in step 5's
batch) flows through both networks into ``BCELoss``, which raises "all elements of input should be between 0 and 1"
on the CPU and kills the process with "device-side assert triggered" on a GPU. Guarded, the NaN is named where it
entered (``batch['x']``), ``binary_cross_entropy`` is refused before it runs, the step is rolled back and the loop
goes on; the frozen layers in the optimizer are said at the first step. Runs as written::

    python examples/plain_loop.py          # 200 steps
    python examples/plain_loop.py --fast   # 10 steps (the test suite runs this)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn, optim

from lightning_numguard import attach

CORRUPT_STEP = 5


class MeanShift(nn.Conv2d):
    """RCAN's fixed colour normalisation (its weights are not to be trained)."""

    def __init__(self) -> None:
        super().__init__(3, 3, kernel_size=1)
        with torch.no_grad():
            self.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
            self.bias.zero_()
        for p in self.parameters():
            p.requires_grad = False


class RCAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub_mean = MeanShift()
        self.head = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.attention = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(16, 16, 1), nn.Sigmoid())
        self.tail = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(self.sub_mean(x))
        r = self.body(h)
        return self.tail(h + r * self.attention(r))


class ModelB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="10 steps (the test suite's run)")
    parser.add_argument("--dir", default="numguard-examples/plain", help="output folder")
    args = parser.parse_args()
    torch.manual_seed(0)
    netG, netB = RCAN(), ModelB()
    optimizerG = optim.Adam(netG.parameters())  # the frozen MeanShift included, as in the story
    optimizerB = optim.Adam(netB.parameters())
    criterion = nn.BCELoss()

    guard = attach({"netG": netG, "netB": netB}, [optimizerG, optimizerB], dirpath=args.dir, emit_warnings=False)

    g = torch.Generator().manual_seed(1)
    for step in range(10 if args.fast else 200):
        lr_images = torch.rand(4, 3, 12, 12, generator=g)
        target = torch.rand(4, 1, 12, 12, generator=g).round()
        if step == CORRUPT_STEP:
            lr_images[1, 0, 6, 6] = float("nan")  # one corrupted pixel
        out = netB(netG(lr_images))
        loss = criterion(out, target)
        optimizerG.zero_grad()
        optimizerB.zero_grad()
        loss.backward()
        optimizerG.step()
        optimizerB.step()
    guard.close()

    for event in guard.events:
        print(f"step {event['step']}: {event['kind']} in {event['where']} -> {event['action']}")
    print("counters:", guard.counters)
    finite = all(bool(torch.isfinite(p).all()) for net in (netG, netB) for p in net.parameters())
    print("weights finite:", finite)


if __name__ == "__main__":
    main()
