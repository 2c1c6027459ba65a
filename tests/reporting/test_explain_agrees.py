"""``numguard explain`` and the end-of-fit summary count the same things (issue 20, item 5).

For real fits with a fault (and the notebook-02 story: a frozen layer handed to Adam, a NaN weight at step
6, BCE after a sigmoid), explain's incidents, rollbacks and skipped steps, read back from ``events.jsonl``,
equal the callback's counters that the summary prints; the first culprit is the NaN, not a warning.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NonFiniteError
from lightning_numguard.reporting.explain import explain
from lightning_numguard.reporting.summary import summarize, summary_text
from tests.doors.trainer.test_zerosync import FusedModel
from tests.helpers import FaultData, FaultModel, loader, trainer


class MeanShift(nn.Conv2d):
    """RCAN's fixed mean subtraction, frozen (``requires_grad=False``) but handed to Adam."""

    def __init__(self) -> None:
        super().__init__(3, 3, kernel_size=1)
        with torch.no_grad():
            self.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
            self.bias.fill_(-0.45)
        self.requires_grad_(False)


class RcanStory(pl.LightningModule):
    """Notebook 02 in miniature: model A (RCAN-like) feeds model B (ends in a sigmoid), trained with BCELoss."""

    def __init__(self, bad_step: int = 6) -> None:
        super().__init__()
        self.model_a = nn.Sequential(MeanShift(), nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding=1))
        self.model_b = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.Flatten(), nn.LazyLinear(1), nn.Sigmoid())
        self.criterion = nn.BCELoss()
        self.bad_step = bad_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        image, target = batch
        if self.global_step == self.bad_step:
            with torch.no_grad():
                self.model_a[2].weight.fill_(float("nan"))
        return self.criterion(self.model_b(self.model_a(image)), target)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)  # every parameter, the frozen ones included


def _rcan(tmp_path: Path) -> NumGuardCallback:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(80, 3, 8, 8, generator=g), (torch.rand(80, 1, generator=g) > 0.5).float())
    model = RcanStory()
    model.model_b(torch.zeros(1, 3, 8, 8))  # materialise the LazyLinear before the optimizer is built
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    trainer(tmp_path, [guard], max_steps=10).fit(model, DataLoader(data, batch_size=8))
    return guard


def _fault(site: str, action: str, **kwargs: Any) -> Any:
    def fit(tmp_path: Path) -> NumGuardCallback:
        guard = NumGuardCallback(action=action, dirpath=str(tmp_path / "ng"), **kwargs)  # type: ignore[arg-type]
        data = FaultData(bad_batch=3 if site == "input" else None, site=site)
        with contextlib.suppress(NonFiniteError):
            trainer(tmp_path, [guard], max_steps=6).fit(FaultModel(site=site, step=3), loader(data))
        return guard

    return fit


def _deferred(tmp_path: Path) -> NumGuardCallback:
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"), sync_mode="deferred")
    trainer(tmp_path, [guard], max_steps=6).fit(FusedModel(site="grad", step=3), loader(FaultData()))
    return guard


SCENARIOS = {
    "rollback_of_a_nan_loss": _fault("loss", "rollback"),
    "rollback_of_a_nan_weight": _fault("param", "rollback", snapshot_every_n_steps=2),
    "skip_of_a_nan_gradient": _fault("grad", "skip"),
    "halt_on_a_nan_batch": _fault("input", "halt"),
    "deferred_device_skip": _deferred,
    "notebook_02_rcan_story": _rcan,
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_explain_counts_equal_the_summary_counts(tmp_path: Path, scenario: str) -> None:
    """Before: "rollback 4" against the summary's one rollback (notebook 02), the coverage warning as the culprit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = SCENARIOS[scenario](tmp_path)
    counters = guard.counters
    assert counters["incidents"] >= 1
    result = explain(tmp_path / "ng")
    explained = result.summary
    assert explained["incidents"] == counters["incidents"]
    assert explained["actions"]["rollback"] == counters["rollbacks"]
    skipped = sum(explained["actions"][a] for a in ("skip", "rollback", "halt"))
    assert skipped == counters["skipped_steps"]
    assert (explained["rollbacks"], explained["skipped_steps"]) == (counters["rollbacks"], counters["skipped_steps"])
    assert explained["first_culprit"]["kind"] != "optimizer_coverage"

    text = summary_text(summarize(guard.events, counters, 0, 6, None))
    n_skipped = counters["skipped_steps"]
    head = text.splitlines()[0]
    acts = explained["actions"]  # one action per incident step, in the summary's words and explain's counts
    for action, words in (("skip", "skipped step"), ("rollback", "rollback"), ("halt", "halt")):
        n = acts[action]
        assert (f" {n} {words}{'s' if n != 1 else ''}" in head) == bool(n), (action, head)
    assert "steps skipped" not in head and "step skipped" not in head  # a rollback is not a skip besides
    assert f"rollback {counters['rollbacks']}," in result.text
    assert f"; {n_skipped} step update(s) dropped in all)" in result.text
    # the header counts the steps with an incident only
    incident_steps = {e["step"] for e in guard.events if e["kind"] != "optimizer_coverage"}
    assert f"in {len(incident_steps)} step(s)" in result.text
    assert "null" not in result.text and "None" not in result.text
    replays = re.findall(r"\n\s+replay: +(.*)", result.text)
    assert len(replays) == len(set(replays))  # a step's shared replay block is printed once
