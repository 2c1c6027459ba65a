"""``numguard demo``: a small CNN with BatchNorm, a fault injected at a chosen step, the guard at work."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_numguard.cli import DEMO_DIR, FAULTS, fault_step
from lightning_numguard.doors.trainer.callback import NumGuardCallback
from lightning_numguard.errors import NonFiniteError, NumGuardWarning
from lightning_numguard.reporting.events import Action

__all__ = ["FAULTS", "run_demo"]  # FAULTS lives in the CLI, which must not import this (torch) module


class _Shapes(Dataset):
    """Generated 16x16 images: class 1 has a bright square, class 0 has none."""

    def __init__(self, n: int, bad_batch: int | None, batch_size: int, fill: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 1, 16, 16, generator=g) * 0.2
        self.y = torch.randint(0, 2, (n,), generator=g)
        for i in range(n):
            if self.y[i]:
                r, c = torch.randint(0, 10, (2,), generator=g).tolist()
                self.x[i, 0, r : r + 6, c : c + 6] += 0.8
        if bad_batch is not None:
            start = bad_batch * batch_size
            self.x[start : start + batch_size, 0, 0, :4] = fill

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.x[i], "label": self.y[i]}


class _StdNorm(nn.Module):
    """A hand-written feature standardisation without an eps (the seeds' "division by a zero std")."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h - h.mean(0)) / h.std(0)


class DemoCNN(pl.LightningModule):
    """Conv-BN-ReLU x2, a linear head, AdamW; ``fault`` fires once at global step ``fault_step``."""

    def __init__(self, fault: str = "none", fault_step: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.norm = _StdNorm()
        self.head = nn.Linear(16, 2)
        self.fault, self.fault_step = fault, fault_step
        self.head.weight.register_hook(self._grad_fault)

    def _now(self) -> bool:
        return self.global_step == self.fault_step

    def _grad_fault(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan") if self.fault == "grad" and self._now() else grad

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.fault == "param" and self._now():
            with torch.no_grad():
                conv = self.features[0]
                assert isinstance(conv, nn.Conv2d)
                conv.weight[0].fill_(float("nan"))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        h = self.features(batch["image"]).flatten(1)
        if self.fault == "output" and self._now():
            h = h * 0.0  # a constant feature: its std is 0 and the normalisation divides 0 by 0
        h = self.norm(h)
        loss = nn.functional.cross_entropy(self.head(h), batch["label"])
        if self.fault == "loss" and self._now():
            loss = loss * float("inf")
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def run_demo(fault: str = "input", action: Action = "rollback", steps: int = 30, out_dir: Path | str = DEMO_DIR) -> str:
    """Train the demo CNN for ``steps`` steps with ``fault`` at step 10 under ``action``; return a summary.

    Args:
        fault: a key of :data:`FAULTS`.
        action: an :data:`~lightning_numguard.reporting.events.Action`.
        steps: training steps.
        out_dir: where TensorBoard logs and ``events.jsonl`` go.

    Raises:
        ValueError: ``fault`` is not a key of :data:`FAULTS`.
    """
    if fault not in FAULTS:
        raise ValueError(f"`fault` must be one of {list(FAULTS)}, got {fault!r}")
    out = Path(out_dir)
    batch_size, fault_at = 16, fault_step(steps)
    data_fault = fault in ("input", "masked-fill")
    fill = float("nan") if fault == "input" else 1e20
    data = _Shapes(batch_size * steps, fault_at if data_fault else None, batch_size, fill)
    model = DemoCNN(fault=fault if not data_fault else "none", fault_step=fault_at)
    guard = NumGuardCallback(action=action)
    logger = TensorBoardLogger(str(out), name="demo")
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[guard],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,
    )
    halted = ""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumGuardWarning)
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        try:
            trainer.fit(model, DataLoader(data, batch_size=batch_size))
        except NonFiniteError as err:
            halted = str(err)
    finite = all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())
    dirpath = guard.resolved_dirpath
    lines = [
        f"numguard demo: fault={fault} at step {fault_at}, action={action}, {trainer.global_step} steps trained",
    ]
    if not guard.events:
        lines.append("  no incident found" + (" (as expected: no fault injected)" if fault == "none" else ""))
    else:
        first = guard.events[0]
        roots = guard.counters["incidents"]
        lines.append(f"  {roots} incident(s) (root causes) in {len(guard.events)} event(s); the first root cause:")
        lines.append(f"    {first['kind']} at step {first['step']} in {', '.join(first['where'])}")
        lines.append(f"    {first['message']}")
        for e in guard.events[1:6]:
            lines.append(
                f"    then {e['kind']} in {', '.join(e['where'][:3])}"
                + (" (a consequence)" if not e.get("root_cause", True) else " (a new root cause)")
            )
        lines.append(
            f"  action: {first['action']}; skipped steps {guard.counters['skipped_steps']}, "
            f"rollbacks {guard.counters['rollbacks']}"
        )
    if halted:
        lines.append(f"  halted: {halted}")
    lines.append(f"  weights finite at the end: {finite}")
    events_file = dirpath / "events.jsonl" if dirpath else None
    if events_file is not None and events_file.exists():  # only paths that were created
        lines.append(f"  events:      {events_file}")
    if dirpath and (dirpath / "last_finite.ckpt").exists():
        lines.append(f"  checkpoint:  {dirpath / 'last_finite.ckpt'}")
    if Path(logger.log_dir).exists():
        lines.append(f"  TensorBoard: tensorboard --logdir {logger.log_dir}")
    if events_file is not None and events_file.exists():
        lines.append(f"  explain:     numguard explain {dirpath}")
    return "\n".join(lines)
