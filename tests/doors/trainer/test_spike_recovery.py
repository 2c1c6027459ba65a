"""The README's spike claim, rollbacks that repeat, and counts that add up (issue 26).

The new user's run: a tiny GPT, AdamW, a ``LambdaLR`` that raises the learning rate 100x for steps 20-24, 60 steps.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_numguard import NumGuardCallback
from tests.helpers import trainer

V, T, D, STEPS = 64, 16, 32, 60
README_CLAIM = (
    "A learning rate raised 100x for five steps leaves a tiny GPT's loss more than twice a clean run's, its gradient "
    "norm 3 to 7x its median: under the default floor, so the defaults let it through. With "
    '`spike_action="rollback"`, `snapshot_every_n_steps=5` and `spikes={"sigma": 2}` (its clean run raises no spike '
    "at that sigma) it ends within 1.5x of the clean run, every raised step rolled back (tested)."
)
#: the sigma of the README's claim: a run whose windows are tight (a batch of 8 here) can afford a low one
SIGMA = 2.0


class TinyGPT(pl.LightningModule):
    """One pre-norm causal Transformer block; the learning rate x``factor`` on scheduler steps 20-24."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.factor = factor
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        self.block = nn.TransformerEncoderLayer(D, 2, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.emb(x) + self.pos, src_mask=self.mask, is_causal=True)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return nn.functional.cross_entropy(self(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: self.factor if 20 <= s <= 24 else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Updates(pl.Callback):
    """AdamW's count of updates made, at batch end before (``first``) or after the guard acted."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        state = trainer.optimizers[0].state
        self.counts[trainer.global_step - 1] = max((int(s["step"]) for s in state.values() if "step" in s), default=0)


def _data() -> tuple[torch.Tensor, DataLoader]:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, V, (16, T + 1), generator=g)
    return base, DataLoader(TensorDataset(base[torch.randint(0, 16, (STEPS * 8,), generator=g)]), batch_size=8)


def _run(tmp_path: Any, factor: float, guard: NumGuardCallback | None = None) -> tuple[float, bool, Any]:
    base, loader = _data()
    model = TinyGPT(factor)
    before, after = Updates(), Updates()
    callbacks = [before, guard, after] if guard is not None else []
    trainer(tmp_path, callbacks, max_steps=STEPS).fit(model, loader)
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(model(base[:, :-1]).flatten(0, 1), base[:, 1:].flatten()))
    return loss, all(torch.isfinite(p).all() for p in model.parameters()), (before.counts, after.counts)


def test_the_readmes_spike_claim_and_counts_that_add_up(tmp_path, caplog):
    from pathlib import Path

    readme = " ".join(Path(__file__).resolve().parents[3].joinpath("README.md").read_text().split())
    assert " ".join(README_CLAIM.split()) in readme  # the claim as written there
    watcher = NumGuardCallback(dirpath=str(tmp_path / "w"), spike_action="warn", spikes={"sigma": SIGMA})
    clean, _, _ = _run(tmp_path / "clean", 1.0, watcher)
    assert watcher.events == [] and watcher.counters["spikes"] == 0  # no false spike at the claim's sigma
    defaults = NumGuardCallback(dirpath=str(tmp_path / "d"), spike_action="warn", emit_warnings=False)
    raised, finite, _ = _run(tmp_path / "raised", 100.0, defaults)
    assert finite and raised > 2 * clean
    assert defaults.counters["spikes"] == 0  # the default floor (43x the median gradient norm) lets it through
    guard = NumGuardCallback(
        dirpath=str(tmp_path / "ng"),
        spike_action="rollback",
        snapshot_every_n_steps=5,
        spikes={"sigma": SIGMA},
        emit_warnings=False,
    )
    from lightning_utilities.core import rank_zero

    # the fit-start line goes where Lightning's own go: `rank_zero_info`'s logger, which the Lightning package
    # imported last names (`pytorch_lightning...` or `lightning.pytorch...`; the suite imports both)
    lightning = rank_zero.log
    lightning.addHandler(caplog.handler)
    level = lightning.level
    lightning.setLevel(logging.INFO)  # the suite quiets Lightning (conftest); a user's run shows it
    try:
        with caplog.at_level(logging.INFO):
            guarded, finite, (before, after) = _run(tmp_path / "guarded", 100.0, guard)
    finally:
        lightning.removeHandler(caplog.handler)
        lightning.setLevel(level)
    assert finite and guarded < 1.5 * clean, (clean, raised, guarded)
    # fit start said when detection arms
    assert any(
        "spike detection (spike_action='rollback') arms after 16 steps" in r.getMessage() for r in caplog.records
    )
    rollbacks = sorted({e["step"] for e in guard.events if e["action"] == "rollback"})
    assert rollbacks and 21 <= min(rollbacks) <= 22 and len(rollbacks) == guard.counters["rollbacks"] <= 10
    # every raised step was rolled back: the rollbacks repeat on the same snapshot, each keeping the schedule's place
    roots = [e for e in guard.events if e["action"] == "rollback" and e.get("root_cause", True)]
    times: dict[int, int] = {}
    causes: list[str] = []
    for e in roots:
        n = times[e["details"]["snapshot_step"]] = times.get(e["details"]["snapshot_step"], 0) + 1
        if n == 1:
            assert "repeat" not in e["details"] and "a repeat" not in e["message"]
            continue
        assert e["details"]["repeat"]["times"] == n and "a repeat (" in e["message"]
        assert "the learning-rate schedule is not rewound" in e["message"]
        causes.append(e["message"].rsplit("; ", 1)[-1])
    assert max(times.values()) >= 2  # the raised steps came round again, and were said to
    # the cause is named: the schedule while the raised rate came round, the same trouble from a later snapshot after
    assert causes[0].startswith("a schedule that brings the learning rate back: it was 0.3 at step")
    assert all(c.startswith(("a schedule that brings", "spike came back after each rollback")) for c in causes)
    # counts: each rollback's steps lost are the updates AdamW actually lost, in the message and in the summary
    lost = {s: before[s] - after[s] for s in rollbacks}
    for e in roots:
        assert e["details"]["steps_lost"] == lost[e["step"]] <= e["step"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NumGuard rolled back at step")]
    assert len(lines) == len(rollbacks)
    for line, step in zip(lines, rollbacks):
        said = re.search(r"\((\d+) steps?\) are lost|: (\d+) updates? made since (?:is|are) lost", line)
        assert said is not None, line
        assert int(said.group(1) or said.group(2)) == lost[step], line
    summary = next(r.getMessage() for r in caplog.records if re.match(r"NumGuard: \d+ incidents? in", r.getMessage()))
    total = sum(lost.values())
    assert f"{len(rollbacks)} rollbacks ({total} step{'s' if total != 1 else ''} lost)" in summary and total <= STEPS
    skips = guard.counters["skipped_steps"] - len(rollbacks)  # a rollback drops its step's update: not a skip besides
    assert (f"{skips} skipped step" in summary) == bool(skips), summary
    # the spike message says how many steps its window spans
    first = roots[0]
    assert f"above the median of its last {first['step']} steps" in first["message"], first["message"]


def test_a_fit_shorter_than_the_warm_up_is_warned_that_spike_detection_cannot_act(tmp_path):
    from lightning_numguard import NumGuardWarning
    from tests.helpers import FaultData, FaultModel, loader

    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), spike_action="skip", spikes={"warmup": 20})
    with pytest.warns(NumGuardWarning, match=r"max_steps=10 ends it before the spike window holds spike_warmup=20"):
        trainer(tmp_path, [guard], max_steps=10).fit(FaultModel(), loader(FaultData()))
    assert guard.events == []
