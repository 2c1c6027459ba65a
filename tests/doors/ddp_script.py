"""Run by test_ddp_doors.py: two gloo processes on the CPU, launched by Fabric, several fits in the one process group.

Usage: python ddp_script.py OUT_DIR

``Fabric(strategy="ddp", devices=2).launch()`` starts rank 1 (this script again) and the process group; then, in
sequence, in both processes:

* ``plain_rollback`` / ``plain_halt``: a plain loop over a DDP-wrapped model, ``attach(ddp_model, optimizer)``;
  a NaN batch on rank 1 (rolled back), then a NaN loss on rank 0 under ``action="halt"``;
* ``fabric_rollback`` / ``fabric_halt`` / ``fabric_accumulate``: a Fabric loop (``fabric.setup``), the guard as
  Fabric's callback; a NaN batch on rank 1, a NaN loss on rank 0 under ``"halt"``, and under
  ``no_backward_sync`` accumulation (2 micro-batches a step) a NaN in window 1's second micro-batch on rank 0.

Each rank writes OUT_DIR/rank{r}.json: per fit, its events, counters, whether its weights are finite and equal to
rank 0's, and what it raised.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.fabric import Fabric

from lightning_numguard import NonFiniteError, attach
from lightning_numguard.fabric import NumGuard


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Current:
    """Fabric's one callback, handing its two hooks to the guard of the fit in progress (a fit per guard)."""

    guard: NumGuard | None = None

    def on_after_setup(self, fabric: Any, module: Any) -> None:
        if self.guard is not None:
            self.guard.on_after_setup(fabric=fabric, module=module)

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        if self.guard is not None:
            self.guard.on_after_optimizer_step(strategy=strategy, optimizer=optimizer)


def data(rank: int, bad: int | None, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    out = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]
    if bad is not None:
        out[bad][0][1, 1] = float("nan")
    return out


def result(net: nn.Module, guard: Any, raised: BaseException | None) -> dict[str, Any]:
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {
        "events": guard.events,
        "counters": guard.counters,
        "finite": bool(torch.isfinite(flat).all()),
        "same_as_rank0": bool(torch.equal(gathered[0], flat)),
        "raised": f"{type(raised).__name__}: {raised}" if raised is not None else None,
    }


def plain_fit(out: Path, rank: int, action: str, bad_rank: int, nan_loss: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = attach(model, optimizer, action=action, dirpath=str(out), emit_warnings=False)
    raised = None
    try:
        for i, (x, y) in enumerate(data(rank, None if nan_loss or rank != bad_rank else 2)):
            loss = F.mse_loss(model(x), y)
            if nan_loss and i == 2 and rank == bad_rank:
                loss = loss * float("nan")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    except NonFiniteError as err:
        raised = err
    guard.close()
    return result(net, guard, raised)


def fabric_fit(
    fabric: Any, current: Current, out: Path, action: str, bad_rank: int, nan_loss: bool, accumulate: int = 1
) -> dict[str, Any]:
    torch.manual_seed(0)
    guard = current.guard = NumGuard(action=action, dirpath=str(out), emit_warnings=False)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rank = fabric.global_rank
    bad = 3 if accumulate > 1 else 2
    raised = None
    try:
        for i, (x, y) in enumerate(data(rank, None if nan_loss or rank != bad_rank else bad)):
            accumulating = (i + 1) % accumulate != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = F.mse_loss(model(x), y)
                if nan_loss and i == 2 and rank == bad_rank:
                    loss = loss * float("nan")
                fabric.backward(loss / accumulate)
            if not accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
    except NonFiniteError as err:
        raised = err
    guard.close()
    current.guard = None
    return result(net, guard, raised)


def main() -> None:
    warnings.simplefilter("ignore")
    out = Path(sys.argv[1])
    current = Current()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", callbacks=[current])
    fabric.launch()
    rank = fabric.global_rank
    fits = {
        "plain_rollback": lambda d: plain_fit(d, rank, "rollback", 1, False),
        "plain_halt": lambda d: plain_fit(d, rank, "halt", 0, True),
        "fabric_rollback": lambda d: fabric_fit(fabric, current, d, "rollback", 1, False),
        "fabric_halt": lambda d: fabric_fit(fabric, current, d, "halt", 0, True),
        "fabric_accumulate": lambda d: fabric_fit(fabric, current, d, "rollback", 0, False, accumulate=2),
    }
    report = {name: fit(out / name) for name, fit in fits.items()}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    # Without this, gloo's worker threads can outlive the interpreter's finalisation and abort the process after a
    # successful run ("terminate called without an active exception", exit -6; pytorch/pytorch#190489). Every rank
    # runs this (Fabric relaunches the script for rank 1).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
