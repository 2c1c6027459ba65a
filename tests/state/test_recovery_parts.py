"""The recovery part and the ledger as tables, without a Trainer: each ``Decision`` carried out on a small model.

A small :class:`~lightning_numguard.engine.loop.Loop` of the test's own carries what the parts read of a training
loop (the module, its optimizer, the step, the rank); the decisions come from ``decide.judge``, as in a fit.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from lightning_numguard.decide.judge import Budget, Decision, Facts, judge
from lightning_numguard.diagnose.findings import Finding
from lightning_numguard.engine.deferred import Candidates
from lightning_numguard.engine.loop import Loop
from lightning_numguard.engine.record import StepRecord
from lightning_numguard.reporting.ledger import Ledger
from lightning_numguard.state.recovery import Recovery
from lightning_numguard.state.snapshots import Snapshots


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class HostLoop(Loop):
    """One process, one optimizer, a step counter the test moves, and a stop request it can read."""

    def __init__(self, model: nn.Module, lr: float, rank: int = 0, epoch: int = 0) -> None:
        super().__init__(model)
        self._optimizers = [torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)]
        self.global_step = 3
        self.should_stop = False
        self._rank, self._epoch = rank, epoch

    @property
    def step(self) -> int:
        return self.global_step

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    def stop(self) -> None:
        self.should_stop = True


def _host(model: nn.Module, lr: float = 0.1) -> Any:
    return HostLoop(model, lr)


def _train_step(model: nn.Module, host: Any) -> None:
    host.optimizers[0].zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    host.optimizers[0].step()


def _parts(lr_backoff: float = 1.0, skip_after: int = 0) -> tuple[Net, Any, Recovery]:
    torch.manual_seed(0)
    model = Net()
    host = _host(model)
    recovery = Recovery(None, Snapshots("host"), skip_after, lr_backoff, retry_transient=False, quarantine=True)
    _train_step(model, host)  # momentum buffers exist: the snapshot holds them too
    recovery.snapshots.take(host)  # the verified state, step 3
    return model, host, recovery


def _record(model: nn.Module, decision: Decision) -> StepRecord:
    rec = StepRecord(epoch=0, batch_idx=5, batch=torch.zeros(4, 3), step=3, decision=decision)
    rec.start_buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    rec.events = [
        {"kind": "nonfinite_loss", "details": {}, "action": decision.action, "message": "m", "step": 3, "where": []}
    ]
    return rec


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


BAD = Facts(incident=True)
STATE_BAD = Facts(incident=True, state_bad=True)


@pytest.mark.parametrize(
    ("action", "facts", "restored", "buffers_back", "stops", "skip_window"),
    [
        ("warn", BAD, False, False, False, 0),
        ("skip", BAD, False, True, False, 0),  # the buffers the bad forward changed are put back, weights kept
        ("rollback", BAD, True, True, False, 2),  # the snapshot: weights, buffers and optimizer state
        ("skip", STATE_BAD, True, True, False, 2),  # escalated: a skip cannot help a bad state
        ("halt", BAD, True, True, True, 0),
    ],
)
def test_recovery_carries_out_each_decision(caplog, action, facts, restored, buffers_back, stops, skip_window):
    model, host, recovery = _parts(skip_after=2)
    recovery.skip_batches_after_rollback = 2
    at_snapshot = _weights(model)
    decision = judge(action, facts, Budget(True, 0, 3))
    rec = _record(model, decision)
    _train_step(model, host)  # the step went ahead (its weights and BatchNorm statistics moved)
    moved = _weights(model)
    with caplog.at_level(logging.WARNING):
        recovery.carry_out(host, rec)
    now = model.state_dict()
    assert torch.equal(now["lin.weight"], at_snapshot["lin.weight"]) == restored
    assert torch.equal(now["lin.weight"], moved["lin.weight"]) == (not restored)
    assert torch.equal(now["norm.running_mean"], at_snapshot["norm.running_mean"]) == buffers_back
    assert host.should_stop is stops
    assert recovery.skip_remaining == skip_window
    if restored:  # the optimizer's momentum too, bitwise
        state = host.optimizers[0].state[model.lin.weight]["momentum_buffer"]
        assert torch.equal(state, recovery.snapshot.optimizers[0]["state"][0]["momentum_buffer"])


def test_a_rollback_backs_the_learning_rate_off_and_says_so():
    model, host, recovery = _parts(lr_backoff=0.5)
    rec = _record(model, judge("rollback", BAD, Budget(True, 0, 3)))
    outcome = recovery.carry_out(host, rec)
    assert host.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)
    assert outcome.lr_after_backoff == [pytest.approx(0.05)]
    assert outcome.restore is not None and outcome.restore.snapshot_step == 3 and outcome.steps_lost == 0
    assert rec.events[0]["details"] == {}  # the built event is left as it is: the ledger records it with the outcome
    ledger = Ledger()
    ledger.record(host, rec.events, outcome=outcome)
    assert ledger.events[0]["details"] == {"steps_lost": 0, "snapshot_step": 3, "lr_after_backoff": [0.05]}


def test_a_batch_that_failed_twice_is_quarantined_by_the_decision():
    model, host, recovery = _parts()
    rec = _record(model, judge("rollback", Facts(incident=True, failures=2), Budget(True, 0, 3)))
    outcome = recovery.carry_out(host, rec)
    assert [q["batch_idx"] for q in recovery.quarantine.entries] == [5]
    assert outcome.quarantined is True and outcome.said_in(rec.events[0])["details"]["quarantined"] is True


@pytest.mark.parametrize(
    ("decision", "grads_dropped", "snapshot_step"),
    [
        (Decision(), False, 0),
        (Decision(keep_start=True), False, 3),
        (judge("skip", BAD, Budget(True, 0, 3)), True, 3),  # the state before the bad step is verified: kept
        (judge("skip", STATE_BAD, Budget(True, 0, 3)), True, 0),  # not kept: it is the bad state
    ],
)
def test_before_the_optimizer_step(decision, grads_dropped, snapshot_step):
    model, host, recovery = _parts()
    recovery.snapshots.snapshot.step = 0  # an older snapshot: a new one would say step 3
    model(torch.randn(4, 3)).sum().backward()
    rec = _record(model, decision)
    recovery.at_read(host, rec, decision, host.optimizers[0])
    assert (model.lin.weight.grad is None) == grads_dropped
    assert recovery.snapshot.step == snapshot_step


def test_read_late_the_candidates_are_verified_or_dropped():
    model, host, recovery = _parts()
    candidates = Candidates(recovery.snapshots)
    candidates.start()
    first = recovery.snapshot
    for step in (4, 5):
        host.global_step = step
        candidates.add(host, StepRecord(epoch=0, batch_idx=step, step=step))
    candidates.judged(4, Decision(keep_start=True))
    assert recovery.snapshot.step == 4 and recovery.snapshot is not first
    candidates.judged(5, judge("rollback", Facts(incident=True, late=True), Budget(True, 0, 3)))
    assert recovery.snapshot.step == 4 and not candidates.view.candidates


def test_the_ledger_owns_the_counters():
    ledger = Ledger()
    host = HostLoop(nn.Linear(1, 1), 0.1, rank=1, epoch=2)
    ledger.count(judge("rollback", BAD, Budget(True, 0, 3)).counts)
    ledger.count(judge("skip", Facts(spike="skip"), Budget(True, 0, 3)).counts)
    ledger.count(judge("rollback", Facts(forced_skip=True), Budget(True, 0, 3)).counts)
    root = Finding("nonfinite_input", ["batch['x']"], {})
    consequence = Finding("nonfinite_loss", ["loss"], {}, root_cause=False, consequence_of="nonfinite_input")
    events = [ledger.event(host, f, 7, "rollback") for f in (root, consequence)]
    ledger.record(host, events)
    assert ledger.counters == {
        "incidents": 1,  # the consequence is the same incident
        "skipped_steps": 3,
        "rollbacks": 1,
        "amp_overflow_steps": 0,
        "spikes": 1,
    }
    assert ledger.rollbacks_this_fit == 1
    assert ledger.incidents_by_kind == {"nonfinite_input": 1, "nonfinite_loss": 1}
    assert [(e["rank"], e["epoch"], e["step"]) for e in ledger.events] == [(1, 2, 7), (1, 2, 7)]
