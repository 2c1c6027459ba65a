"""Run by test_trust_ddp.py in a subprocess: real DDP (gloo, WORLD CPU processes), faults of the machine and of the
data on one rank, three fits in one launched process group.

Usage: python trust_ddp_script.py OUT_DIR WORLD FAULT_RANK

Fits, in order, each under OUT_DIR/<mode>:

* ``transient``: a forward hook on ``net.2`` flips one activation to NaN on FAULT_RANK, on the first call at step 2
  only (the replay of the step calls it again and finds it finite);
* ``persistent``: the same hook fires on FAULT_RANK at every call of steps 2, 3 and 4 (its replays included), never
  on another rank: the neighbour's re-run of the same micro-batch is finite; the third halts;
* ``data``: FAULT_RANK's batch at step 2 holds a value whose ``log`` in ``training_step`` is NaN: every rank that
  runs that micro-batch makes it.

Each rank writes OUT_DIR/<mode>/rank{r}.json: its events, what the fit raised, the guard's state and (rank 0) the
end-of-fit summary.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_numguard import NumGuardCallback
from tests.helpers import quiet_trainer

MODES = ("transient", "persistent", "data")
BATCH = 4


class Net(pl.LightningModule):
    def __init__(self, mode: str, fault_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.mode, self.fault_rank = mode, fault_rank
        self.done: set[int] = set()
        self.net[2].register_forward_hook(self._flip)

    def _flip(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        steps = {"transient": (2,), "persistent": (2, 3, 4)}.get(self.mode, ())
        step = self.global_step
        if self.global_rank != self.fault_rank or step not in steps:
            return None
        if self.mode == "transient":
            if step in self.done:
                return None
            self.done.add(step)
        out = out.clone()
        out[0, 0] = float("nan")
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x) + torch.log(x[:, :1] + 10.0)  # NaN for a value below -10: a fault of the data
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Summary(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fit(out: Path, mode: str, world: int, fault_rank: int) -> None:
    pl.seed_everything(0, verbose=False)
    guard = NumGuardCallback(dirpath=str(out / "ng"), emit_warnings=False)
    trainer = quiet_trainer(
        [guard], devices=world, strategy="ddp", max_steps=6, use_distributed_sampler=False, enable_checkpointing=False
    )
    rank = trainer.global_rank
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(6 * BATCH, 4, generator=g), torch.randn(6 * BATCH, 1, generator=g)
    if mode == "data" and rank == fault_rank:
        x[2 * BATCH, 0] = -20.0  # batch 2: finite, and its log in training_step is NaN
    handler = Summary()
    logging.getLogger("lightning_numguard.reporting.progress").addHandler(handler)
    raised = None
    try:
        trainer.fit(Net(mode, fault_rank), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    except Exception as err:  # every rank raises together
        raised = {"type": type(err).__name__, "message": str(err), **{k: getattr(err, k, None) for k in _FIELDS}}
    finally:
        logging.getLogger("lightning_numguard.reporting.progress").removeHandler(handler)
    faults = guard.state_dict()["device_faults"]  # what a resumed run goes on counting from
    result = {"events": guard.events, "raised": raised, "device_faults": faults, "summary": handler.lines}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


_FIELDS = ("rank", "host", "device", "faults")


def main(argv: list[str] | None = None) -> None:
    """The command line without the program (``sys.argv[1:]``, or what ``pack_script.py`` hands over)."""
    args = sys.argv[1:] if argv is None else argv
    root, world, fault_rank = Path(args[0]), int(args[1]), int(args[2])
    warnings.simplefilter("ignore")
    for mode in MODES:
        out = root / mode
        out.mkdir(parents=True, exist_ok=True)
        fit(out, mode, world, fault_rank)


if __name__ == "__main__":
    main()
    # gloo's worker threads can outlive the interpreter's finalisation (see ddp_script.py)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
