"""The guard's Python work per step, counted in bytecodes (it does not move with the machine's load): it does not grow
with the number of parameters, so no Python loop over them runs every step (``benchmarks/host_work.py`` gives the
counts of the benchmark models)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_numguard.callbacks import NumGuardCallback
from tests.helpers import FaultData, loader, trainer

PACKAGE = "/lightning_numguard/"
FIRST, LAST = 3, 9  # the steps counted: past the first step's set-up, none a snapshot's


class ManyParams(pl.LightningModule):
    """One ``Linear`` and ``n`` more small parameters in one container (no more watched blocks as ``n`` grows)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.extra = nn.ParameterList([nn.Parameter(torch.zeros(2)) for _ in range(n)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch["x"], batch["y"]
        tied = torch.stack([p.sum() for p in self.extra]).sum() * 0.0  # every parameter gets a gradient
        return nn.functional.mse_loss(self.layer(x), y) + tied

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Count:
    """Bytecodes executed in the package's files, and frames of them entered (Python calls), between two callbacks'
    hooks, in the steps counted."""

    def __init__(self) -> None:
        self.bytecodes = 0
        self.calls = 0
        self.steps = 0

    def _opcode(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.bytecodes += 1
        return self._opcode

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if PACKAGE not in frame.f_code.co_filename:
            return None
        self.calls += 1
        frame.f_trace_opcodes = True
        return self._opcode

    def start(self, step: int) -> None:
        if FIRST <= step < LAST:
            self.steps += 1
            sys.settrace(self._trace)

    def stop(self) -> None:
        sys.settrace(None)


class _Start(pl.Callback):
    def __init__(self, count: _Count) -> None:
        self.count = count

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.count.start(trainer.global_step)


class _End(pl.Callback):
    def __init__(self, count: _Count) -> None:
        self.count = count

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.count.stop()


def _counted(tmp_path: Any, n: int) -> _Count:
    count = _Count()
    guard = NumGuardCallback(dirpath=str(tmp_path / f"ng{n}"))
    try:
        trainer(tmp_path, [_Start(count), guard, _End(count)], max_steps=LAST + 1).fit(
            ManyParams(n), loader(FaultData(n=8 * (LAST + 2)))
        )
    finally:
        sys.settrace(None)
    assert count.steps == LAST - FIRST and not guard.events
    return count


def _per_step(tmp_path: Any, n: int) -> float:
    count = _counted(tmp_path, n)
    return count.bytecodes / count.steps


def test_the_guards_python_work_per_step_does_not_grow_with_the_number_of_parameters(tmp_path):
    few, many = _per_step(tmp_path, 4), _per_step(tmp_path, 400)
    assert few > 1000, "the counter saw no guard code"
    # a Python loop over the parameters costs at least a few bytecodes per parameter: 396 more would add over 1000
    assert abs(many - few) < 100, (few, many)


#: the most Python calls a clean step may make into the package (the defaults, one process, the model above: 110 when
#: this was written, 182 at ``b0226cf``, before the step's calls were cut; ``benchmarks/host_work.py`` counts the
#: benchmark models')
CALLS_PER_STEP = 120


def test_a_clean_step_makes_at_most_its_budget_of_python_calls(tmp_path):
    """In a real fit a Python call costs the host far more than its bytecodes (a microsecond or more between the
    model's own work): the count of calls a clean step makes is the guard's host cost that does not move with the
    machine's load, held here as the op count is by ``tests/doors/trainer/test_op_budget.py``."""
    count = _counted(tmp_path, 4)
    per_step = count.calls / count.steps
    assert 50 < per_step <= CALLS_PER_STEP, per_step
