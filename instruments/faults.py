"""Small fault-injecting models and data, and the quiet CPU Trainer, shared by the tests and the benchmarks.

A fault is injected at a chosen global ``step``, ``site`` and ``rank``:

=============  ==============================================================================
site           what goes non-finite
=============  ==============================================================================
``input``      the batch itself (the dataset yields NaN for every sample of that batch)
``masked``     the batch holds numpy's masked-array fill value 1e20 (finite but absurd)
``output``     the output of module ``body.1`` (its forward multiplies by NaN)
``loss``       the loss (NaN added after the forward pass)
``grad``       the gradient of ``head.weight`` (a tensor hook returns NaN)
``param``      the parameter ``body.0.weight`` (set to NaN in ``on_train_batch_start``)
``buffer``     BatchNorm's ``running_var`` (set to NaN in ``on_train_batch_start``)
``opt_state``  AdamW's ``exp_avg_sq`` of ``head.weight`` (set to NaN in ``on_train_batch_start``)
``op``         a BCE term gets probabilities above 1 (CUDA: a device-side assert; CPU: a RuntimeError)
=============  ==============================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

SITES = ("input", "masked", "output", "loss", "grad", "param", "buffer", "opt_state", "op")
#: Text that the guard's warning about a fault at each site contains (for ``guard_warning``).
SITE_CULPRIT = {
    "input": "batch['x']",
    "masked": "batch['x']",
    "output": "module `body.1`",
    "loss": "the loss is non-finite",
    "grad": "head.weight",
    "param": "body.0.weight",
    "buffer": "body.2.running_var",
    "opt_state": ".exp_avg_sq",
    "op": "binary_cross_entropy",
}
#: Text of the guard's one warning about a fault at each site: it names the root cause. A poisoned Adam moment
#: is found a step later with the weight its update ruined; the weight comes first and the moment is recorded as
#: its consequence (an event whose message holds ``SITE_CULPRIT["opt_state"]``, not a warning).
SITE_WARNING = {**SITE_CULPRIT, "opt_state": "head.weight"}


class FaultData(Dataset):
    """``n`` samples of (x, y); the samples of batch ``bad_batch`` are poisoned for the ``input``/``masked`` sites."""

    def __init__(
        self,
        n: int = 64,
        dim: int = 8,
        bad_batch: int | None = None,
        batch_size: int = 8,
        site: str = "input",
        seed: int = 0,
        omit_batch: int | None = None,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.idx = list(range(n))
        if omit_batch is not None:
            drop = set(range(omit_batch * batch_size, (omit_batch + 1) * batch_size))
            self.idx = [i for i in self.idx if i not in drop]
        self.bad = set()
        if bad_batch is not None and site in ("input", "masked"):
            self.bad = set(range(bad_batch * batch_size, (bad_batch + 1) * batch_size))
        self.site = site

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = self.idx[i]
        x = self.x[j].clone()
        if j in self.bad:
            x[0] = float("nan") if self.site == "input" else 1e20
        return {"x": x, "y": self.y[j], "index": j}


class _Poison(nn.Module):
    """Multiplies by NaN when ``armed``: a module whose output goes non-finite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        return out * float("nan") if self.armed else out


class FaultModel(pl.LightningModule):
    """MLP with BatchNorm, AdamW with weight decay, a per-step LR scheduler and a torchmetrics metric."""

    def __init__(
        self,
        site: str | None = None,
        step: int = 3,
        rank: int | None = None,
        dim: int = 8,
        lr: float = 1e-2,
        once: bool = False,
    ) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 16), _Poison(), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.metric = torchmetrics.MeanSquaredError()
        self.site, self.fault_step, self.fault_rank, self.lr, self.once = site, step, rank, lr, once
        self.fired = 0
        self.head.weight.register_hook(self._grad_hook)

    def _armed(self) -> bool:
        if self.site is None or self.global_step != self.fault_step:
            return False
        if self.once and self.fired:
            return False
        return self.fault_rank is None or self.global_rank == self.fault_rank

    def _grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self.site == "grad" and self._armed():
            self.fired += 1
            return grad * float("nan")
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self._armed():
            return
        with torch.no_grad():
            if self.site == "param":
                self.body[0].weight[0, 0] = float("nan")
            elif self.site == "buffer":
                self.body[2].running_var[0] = float("nan")
            elif self.site == "opt_state":
                opt = self.trainer.optimizers[0]
                state = opt.state.get(self.head.weight)
                if state:
                    state["exp_avg_sq"].fill_(float("nan"))
            else:
                return
        self.fired += 1

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.body[1].armed = self.site == "output" and self._armed()
        if self.body[1].armed:
            self.fired += 1
        out = self(batch["x"])
        loss = nn.functional.mse_loss(out, batch["y"])
        if self.site == "loss" and self._armed():
            self.fired += 1
            loss = loss + float("nan")
        if self.site == "op":
            probs = torch.sigmoid(out)
            if self._armed():
                self.fired += 1
                probs = probs + 1.5
            loss = loss + nn.functional.binary_cross_entropy(probs, (batch["y"] > 0).float())
        self.metric.update(out.detach(), batch["y"])
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(data: Dataset, batch_size: int = 8) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=0)


#: What every test Trainer leaves out: the GPU, loggers, checkpoints, the progress bar and the model summary.
QUIET: dict[str, Any] = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def quiet_trainer(
    callbacks: list[Any] | None = None, trainer_class: Callable[..., Any] = pl.Trainer, **overrides: Any
) -> Any:
    """The one quiet CPU Trainer of the tests: ``QUIET``, then ``overrides`` (any ``Trainer`` argument, one of
    ``QUIET``'s included); ``trainer_class`` is ``pl.Trainer`` or ``lightning.pytorch.Trainer``."""
    return trainer_class(callbacks=callbacks, **{**QUIET, **overrides})


def trainer(tmp_path: Any, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer writing under ``tmp_path``: one device, one epoch, deterministic."""
    defaults: dict[str, Any] = dict(default_root_dir=str(tmp_path), max_epochs=1, devices=1, deterministic=True)
    return quiet_trainer(callbacks, **{**defaults, **kwargs})


def all_finite(state: dict[str, Any]) -> bool:
    """Whether every floating tensor in a (nested) state dict is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(all_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(all_finite(v) for v in state)
    return True
