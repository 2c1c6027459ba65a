"""Fault scenarios with a known true culprit, each a small real model trained by a real Trainer.

Every scenario injects its fault at global step ``BAD_STEP``; the faulty line is in this file, so
the guard's ``source`` must point here. Used by ``test_scenarios.py`` and by
``python -m benchmarks.diagnosis_table``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from instruments.faults import quiet_trainer

BAD_STEP = 1


class Attention(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.q, self.k, self.mode = nn.Linear(8, 8), nn.Linear(8, 8), mode

    def forward(self, h: torch.Tensor, bad: bool) -> torch.Tensor:
        if bad and self.mode == "fp16":
            h = h * 1e3  # large but finite activations: q and k fit float16, their product does not (max 65504)
        q, k = self.q(h), self.k(h)
        scores = q @ k.transpose(-1, -2)
        if bad and self.mode == "masked":
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool), float("-inf"))  # all masked
        return torch.softmax(scores, dim=-1) @ h


class Custom(nn.Module):
    """The faulty op of one scenario, inside a module named ``custom``."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, h: torch.Tensor, bad: bool) -> torch.Tensor:
        if self.mode == "zero_std":
            h = h * 0 + 0.5 if bad else h
            return (h - h.mean(0, keepdim=True)) / h.std(0, keepdim=True)
        if self.mode == "sqrt0":
            h = h * 0 + 0.5 if bad else h
            return h * torch.var(h, dim=1, unbiased=False, keepdim=True).sqrt()
        if self.mode == "batch_stat":
            h = h[:1].expand_as(h) if bad else h  # every sample the same: the batch's spread is 0
            return (h - h.mean(0)) / (h - h.mean(0)).abs().mean(0)
        if self.mode == "pow":
            base = h - 2.0 if bad else h.abs() + 1.0
            return torch.pow(base, 0.5)
        if self.mode == "acos":
            cos = h.tanh() * 0 + 1.0001 if bad else h.tanh() * 0.9  # a cosine just past 1
            return torch.acos(cos)
        return h


class Scenario(pl.LightningModule):
    """Linear -> (attention | custom op) -> head; ``fault`` decides what goes wrong at BAD_STEP."""

    def __init__(self, fault: str, lr: float = 0.05, adam: bool = False) -> None:
        super().__init__()
        self.fault, self.lr, self.adam = fault, lr, adam
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 8)
        self.custom = Custom(fault)
        attention = fault in ("softmax_masked", "fp16_attention")
        self.attn = Attention("masked" if fault == "softmax_masked" else "fp16") if attention else nn.Identity()
        self.head = nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, tokens, y = batch
        bad = self.global_step == BAD_STEP
        if self.fault == "embedding_index" and bad:
            tokens = tokens.clone()
            tokens[0] = 10  # one past the vocabulary
        h = self.body(x + self.emb(tokens))
        if self.fault == "bce_upstream_nan" and bad:
            with torch.no_grad():
                self.body.bias.fill_(float("nan"))  # a weight already NaN upstream of the BCE
        if self.fault == "bce_upstream_nan":
            h = self.body(x + self.emb(tokens))
        h = self.custom(h, bad)
        if self.fault in ("softmax_masked", "fp16_attention"):
            h = self.attn(h, bad)
        logits = self.head(h)
        if self.fault == "gather_index":
            idx = y.unsqueeze(1) + (3 if bad else 0)  # an index past the 3 classes
            return -torch.gather(logits.log_softmax(-1), 1, idx).mean()
        if self.fault == "log0_loss":
            p = torch.sigmoid(logits[:, 0])
            p = p * 0 if bad else p  # a probability of exactly 0
            return -torch.log(p).mean()
        if self.fault == "bce_upstream_nan":
            return nn.functional.binary_cross_entropy(torch.sigmoid(logits[:, 0]), (y > 0).float())
        if self.fault == "cross_entropy_index" and bad:
            y = y.clone()
            y[0] = 3  # a label one past the classes
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self) -> Any:
        if self.fault == "frozen_in_adam":
            self.body.requires_grad_(False)
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        if self.adam:
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data(fault: str) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = 32
    x = torch.randn(n, 4, generator=g)
    if fault == "masked_fill_values":
        x[BAD_STEP * 8 + 2, 1] = 1e20  # numpy's masked-array fill value, leaked into the batch
    tokens = torch.randint(0, 10, (n,), generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, tokens, y), batch_size=8)


@dataclass(frozen=True)
class Case:
    """One scenario: its true culprit, and what the guard's first event must say."""

    name: str
    story: str
    culprit: str  # the true culprit, in words
    kind: str  # the first event's kind
    op: str | None  # the first event's op (None: no op is to blame)
    module: str | None = None
    hint: str | None = None  # words the first event's message must hold (the advice that fits this culprit)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 3


def _fp16() -> dict[str, Any]:
    from pytorch_lightning.plugins import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}


CASES: list[Case] = [
    Case("bce_upstream_nan", "BCE fed an upstream NaN", "`body.bias` already NaN", "nonfinite_param", None),
    Case("frozen_in_adam", "frozen layers in Adam", "frozen `body` handed to Adam", "optimizer_coverage", None),
    Case("zero_std", "division by a zero std", "`div` by std 0 in `custom`", "nonfinite_output", "div", "custom"),
    Case("sqrt0", "sqrt(0) in a norm", "sqrt's backward at 0", "nonfinite_grad", "SqrtBackward0", "custom"),
    Case("masked_fill_values", "masked-array fill values", "1e20 in the batch", "suspicious_input", None),
    Case(
        "softmax_masked",
        "softmax over a fully masked row",
        "`softmax` of an all -inf row",
        "nonfinite_output",
        "softmax",
        "attn",
    ),
    Case("log0_loss", "log(0) in a custom loss", "`log` of 0 in the loss", "nonfinite_loss", "log"),
    Case(
        "fp16_attention",
        "fp16 overflow of attention logits (GradScaler)",
        "`matmul` overflowing float16",
        "nonfinite_output",
        "matmul",
        "attn",
        hint="overflowed float16",
        trainer_kwargs={"__fp16__": True},
    ),
    Case(
        "diverging_lr",
        "a diverging learning rate",
        "lr=1e12: huge finite weights, `linear` overflows",
        "nonfinite_output",
        "linear",
        "body",
        hint="the learning rate is probably too high",
        model_kwargs={"lr": 1e12},
        steps=6,
    ),
    Case(
        "pow", "pow of a negative base to a fractional exponent", "`pow(-x, 0.5)`", "nonfinite_output", "pow", "custom"
    ),
    Case(
        "batch_stat",
        "division by a batch statistic in a custom norm",
        "`div` by a batch spread of 0",
        "nonfinite_output",
        "div",
        "custom",
    ),
    Case("acos", "acos just outside [-1, 1]", "`acos(1.0001)`", "nonfinite_output", "acos", "custom"),
    Case(
        "embedding_index",
        "index out of range in an embedding",
        "token id 10 >= num_embeddings",
        "op_domain",
        "embedding",
        "emb",
    ),
    Case("gather_index", "index out of range in a gather", "gather index 3 >= 3", "op_domain", "gather"),
    Case(
        "cross_entropy_index",
        "index out of range in cross_entropy",
        "label 3 >= 3 classes",
        "op_domain",
        "cross_entropy",
    ),
]


def make_trainer(case: Case, callbacks: list[Any], root: str, **extra: Any) -> pl.Trainer:
    kwargs = dict(case.trainer_kwargs)
    if kwargs.pop("__fp16__", False):
        kwargs.update(_fp16())
    return quiet_trainer(callbacks, max_steps=case.steps, devices=1, default_root_dir=root, **kwargs, **extra)


def run_guarded(case: Case, root: str) -> dict[str, Any]:
    """Train ``case`` with the guard (``action="skip"``); its first event, and the guard."""
    from lightning_numguard import NumGuardCallback

    guard = NumGuardCallback(action="skip", dirpath=f"{root}/ng")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(case, [guard], root).fit(Scenario(case.name, **case.model_kwargs), data(case.name))
    first = guard.events[0] if guard.events else {}
    return {"event": first, "events": guard.events}


def run_detect_anomaly(case: Case, root: str) -> str:
    """What ``Trainer(detect_anomaly=True)`` without the guard says: the error's first line, or nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            make_trainer(case, [], root, detect_anomaly=True).fit(
                Scenario(case.name, **case.model_kwargs), data(case.name)
            )
        except Exception as err:  # what a user would see
            return f"crashed with {type(err).__name__}: {str(err).splitlines()[0][:110]}"
    return "said nothing"


def first_op(event: dict[str, Any]) -> str | None:
    """The op the guard's event names (its ``op`` field)."""
    return event.get("op")


def message_holds(event: dict[str, Any]) -> bool:
    """No sentence claims a check that did not run."""
    checked = set((event.get("details") or {}).get("checked") or ())
    msg = event.get("message", "")
    if "module output" in msg and "were finite" in msg and "outputs" not in checked:
        return False
    if "the loss was finite" in msg and "loss" not in checked:
        return False
    return not ("from finite inputs" in msg and not event.get("op"))


def culprit_right(case: Case, event: dict[str, Any]) -> bool:
    """The event names the case's kind, op and module, and gives the advice the case expects."""
    if (event.get("kind"), event.get("op")) != (case.kind, case.op):
        return False
    if case.module is not None and event.get("module") != case.module:
        return False
    return case.hint is None or case.hint in event.get("message", "")


def scenario_table() -> str:
    """The project's scenarios, each run with the guard, as a markdown table (``docs/diagnosis.md``)."""
    import logging
    import tempfile
    from pathlib import Path

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the fits' own warnings; put back after, for the tests that run later
    try:
        rows = [
            "| scenario | true culprit | guard: first culprit | op | user line | right? | message holds? |",
            "|---|---|---|---|---|---|---|",
        ]
        for case in CASES:
            with tempfile.TemporaryDirectory() as root:
                event = run_guarded(case, root)["event"]
            where = ", ".join(event.get("where", [])[:2])
            source = event.get("source") or "-"
            line = f"{Path(source.rsplit(':', 1)[0]).name}:{source.rsplit(':', 1)[1]}" if source != "-" else "-"
            rows.append(
                f"| {case.story} | {case.culprit} | {event.get('kind', 'nothing found')} `{where}` "
                f"| {event.get('op') or '-'} | {line} | {'yes' if culprit_right(case, event) else '**no**'} "
                f"| {'yes' if event and message_holds(event) else 'no'} |"
            )
    finally:
        logging.disable(previous)
    return "\n".join(rows)


SCENARIO_FUNCS: dict[str, Callable[..., Any]] = {"guarded": run_guarded, "anomaly": run_detect_anomaly}
