"""The action policy as a table: action x what was found x the budget -> what is done."""

from __future__ import annotations

import pytest

from lightning_numguard.decide.policy import decide, is_amp_overflow, snapshot_due

# action, state_bad, has_incident, have_snapshot, rollbacks_used, max_rollbacks -> decided
DECISIONS = [
    ("warn", False, True, True, 0, 10, "warn"),
    ("warn", True, True, False, 99, 0, "warn"),  # warn never escalates
    ("skip", False, True, True, 0, 10, "skip"),
    ("skip", False, True, False, 0, 10, "skip"),  # a skip needs no snapshot
    ("skip", True, True, True, 0, 10, "rollback"),  # the state itself went bad: skipping would keep it
    ("skip", True, True, False, 0, 10, "halt"),  # ... and without a snapshot there is nothing to roll back to
    ("skip", True, True, True, 10, 10, "halt"),  # ... or the rollback budget is spent
    ("rollback", False, True, True, 0, 10, "rollback"),
    ("rollback", False, True, True, 9, 10, "rollback"),
    ("rollback", False, True, True, 10, 10, "halt"),  # budget spent
    ("rollback", False, True, True, 0, 0, "halt"),  # max_rollbacks=0: halt at once
    ("rollback", False, True, False, 0, 10, "halt"),  # no verified-finite snapshot
    ("rollback", False, False, True, 10, 10, "rollback"),  # a forced skip spends no budget
    ("rollback", True, True, True, 0, 10, "rollback"),
    ("halt", False, True, True, 0, 10, "halt"),
    ("halt", True, True, False, 0, 10, "halt"),
]


@pytest.mark.parametrize(("action", "state_bad", "incident", "snapshot", "used", "budget", "expected"), DECISIONS)
def test_decide(action, state_bad, incident, snapshot, used, budget, expected):
    got = decide(
        action,
        state_bad=state_bad,
        has_incident=incident,
        have_snapshot=snapshot,
        rollbacks_used=used,
        max_rollbacks=budget,
    )
    assert got == expected


# grads_bad, has_scaler, local_incident, state_bad -> the GradScaler's business
AMP = [
    (True, True, False, False, True),
    (True, False, False, False, False),  # no scaler: a real incident
    (True, True, True, False, False),  # a NaN input or loss came first: an incident
    (True, True, False, True, False),  # the weights are bad: an incident
    (False, True, False, False, False),  # nothing non-finite in the gradients
]


@pytest.mark.parametrize(("grads", "scaler", "local", "state", "expected"), AMP)
def test_amp_overflow_is_the_scalers_business_only_when_nothing_else_went_bad(grads, scaler, local, state, expected):
    assert is_amp_overflow(grads_bad=grads, has_scaler=scaler, local_incident=local, state_bad=state) is expected


@pytest.mark.parametrize(
    ("action", "step", "last", "every", "expected"),
    [
        ("rollback", 50, 0, 50, True),
        ("rollback", 49, 0, 50, False),
        ("skip", 1, 0, 1, True),
        ("warn", 100, 0, 1, False),  # warn keeps no snapshots
        ("halt", 10, -(10**9), 50, True),  # never snapshotted
    ],
)
def test_snapshot_due(action, step, last, every, expected):
    assert snapshot_due(action, step, last, every) is expected
