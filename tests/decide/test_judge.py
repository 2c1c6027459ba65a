"""The judgement of a step's read, as a table: the same rules for both read schedules, no Trainer."""

from __future__ import annotations

import pytest

from lightning_numguard.decide.judge import FAILED_TWICE, Budget, Decision, Facts, judge

OK = Budget(have_snapshot=True, rollbacks_used=0, max_rollbacks=3)
NO_SNAPSHOT = Budget(have_snapshot=False, rollbacks_used=0, max_rollbacks=3)
SPENT = Budget(have_snapshot=True, rollbacks_used=3, max_rollbacks=3)

# action, facts, budget -> action, counts, keep_start, drop_start, restore, new_rollback, escalation (substring)
TABLE = [
    # a clean step: a snapshot is kept when due; read late, it verifies the candidates
    ("rollback", Facts(), OK, "none", {}, False, False, False, False, None),
    ("rollback", Facts(snapshot_due=True), OK, "none", {}, True, False, False, False, None),
    ("rollback", Facts(late=True), OK, "none", {}, True, False, False, False, None),
    (
        "rollback",
        Facts(amp_overflow=True, snapshot_due=True),
        OK,
        "none",
        {"amp_overflow_steps": 1},
        True,
        False,
        False,
        False,
        None,
    ),
    # an incident in the forward or backward pass: the state before the step is verified and kept
    ("warn", Facts(incident=True), OK, "warn", {}, False, False, False, False, None),
    ("skip", Facts(incident=True), OK, "skip", {"skipped_steps": 1}, True, False, False, False, None),
    (
        "rollback",
        Facts(incident=True),
        OK,
        "rollback",
        {"skipped_steps": 1, "rollbacks": 1},
        True,
        False,
        True,
        True,
        None,
    ),
    ("halt", Facts(incident=True), OK, "halt", {"skipped_steps": 1}, True, False, True, False, None),
    # the state itself went bad: nothing of it is kept; a skip cannot help
    (
        "skip",
        Facts(incident=True, state_bad=True),
        OK,
        "rollback",
        {"skipped_steps": 1, "rollbacks": 1},
        False,
        False,
        True,
        True,
        "no longer finite",
    ),
    (
        "rollback",
        Facts(incident=True, state_bad=True),
        NO_SNAPSHOT,
        "halt",
        {"skipped_steps": 1},
        False,
        False,
        True,
        False,
        "no verified-finite snapshot",
    ),
    (
        "rollback",
        Facts(incident=True),
        SPENT,
        "halt",
        {"skipped_steps": 1},
        True,
        False,
        True,
        False,
        "max_rollbacks reached (3 rollbacks",
    ),
    # read late: the device skipped the step; only a bad state is restored, and the candidates since are dropped
    ("rollback", Facts(incident=True, late=True), OK, "skip", {"skipped_steps": 1}, False, True, False, False, None),
    (
        "rollback",
        Facts(incident=True, state_bad=True, late=True),
        OK,
        "rollback",
        {"skipped_steps": 1, "rollbacks": 1},
        False,
        True,
        True,
        True,
        None,
    ),
    ("warn", Facts(incident=True, late=True), OK, "warn", {}, False, True, False, False, None),
    # read late, nothing left to act on (a field declared a convention), but the device skipped the step
    (
        "rollback",
        Facts(late=True, device_skipped=True),
        OK,
        "skip",
        {"skipped_steps": 1},
        True,
        False,
        False,
        False,
        None,
    ),
    # a batch known to be bad: skipped quietly, no rollback counted
    ("skip", Facts(forced_skip=True), OK, "skip", {"skipped_steps": 1}, True, False, False, False, None),
    ("rollback", Facts(forced_skip=True), OK, "rollback", {"skipped_steps": 1}, True, False, True, False, None),
    ("warn", Facts(forced_skip=True), OK, "skip", {"skipped_steps": 1}, True, False, False, False, None),
    ("rollback", Facts(forced_skip=True, late=True), OK, "skip", {"skipped_steps": 1}, True, False, False, False, None),
    (
        "rollback",
        Facts(forced_skip=True, state_bad=True, late=True),
        OK,
        "skip",
        {"skipped_steps": 1},
        False,
        True,
        False,
        False,
        None,
    ),
    # a finite spike acts by the spike's action (already escalated), never keeps its state
    ("rollback", Facts(spike="warn"), OK, "warn", {"spikes": 1}, False, False, False, False, None),
    (
        "rollback",
        Facts(spike="skip", snapshot_due=True),
        OK,
        "skip",
        {"spikes": 1, "skipped_steps": 1},
        False,
        False,
        False,
        False,
        None,
    ),
    (
        "skip",
        Facts(spike="rollback", late=True),
        OK,
        "rollback",
        {"spikes": 1, "skipped_steps": 1, "rollbacks": 1},
        False,
        True,
        True,
        True,
        None,
    ),
    (
        "rollback",
        Facts(spike="rollback"),
        NO_SNAPSHOT,
        "halt",
        {"spikes": 1, "skipped_steps": 1},
        False,
        False,
        True,
        False,
        "no verified-finite snapshot",
    ),
    ("rollback", Facts(spike="warn", late=True), OK, "warn", {"spikes": 1}, False, False, False, False, None),
]


@pytest.mark.parametrize(
    ("action", "facts", "budget", "taken", "counts", "keep", "drop", "restore", "new_rollback", "escalation"), TABLE
)
def test_judge_table(action, facts, budget, taken, counts, keep, drop, restore, new_rollback, escalation):
    d = judge(action, facts, budget)
    assert (d.action, dict(d.counts), d.keep_start, d.drop_start, d.restore, d.new_rollback) == (
        taken,
        counts,
        keep,
        drop,
        restore,
        new_rollback,
    )
    if escalation is None:
        assert d.escalation is None
    else:
        assert d.escalation is not None and escalation in d.escalation
    assert d.skips == (taken in ("skip", "rollback", "halt"))


@pytest.mark.parametrize(
    ("action", "facts", "quarantine", "retry", "expected"),
    [
        ("rollback", Facts(incident=True, failures=2), True, False, FAILED_TWICE),
        ("skip", Facts(incident=True, failures=2, late=True), True, False, FAILED_TWICE),
        ("rollback", Facts(incident=True, failures=1), True, False, None),
        ("rollback", Facts(incident=True, failures=2), False, False, None),
        ("rollback", Facts(incident=True, failures=2), True, True, None),  # the retry's outcome decides instead
        ("warn", Facts(incident=True, failures=5), True, False, None),  # "warn" never takes a batch away
        ("halt", Facts(incident=True, failures=2), True, False, None),
        ("rollback", Facts(spike="rollback", failures=2), True, False, None),  # a spike is not the batch's fault
    ],
)
def test_a_batch_position_that_failed_twice_is_quarantined(action, facts, quarantine, retry, expected):
    assert judge(action, facts, OK, quarantine=quarantine, retry=retry).quarantine == expected


def test_a_clean_decision_changes_nothing():
    d = Decision()
    assert not d.skips and not d.restore and not d.counts and d.quarantine is None


def test_a_halt_after_repeated_rollbacks_names_what_they_share():
    cause = "a schedule that brings the learning rate back: it was 0.3 at step 21 and 0.3 at step 43"
    d = judge("rollback", Facts(incident=True), Budget(True, 10, 10, cause))
    assert d.action == "halt"
    assert d.escalation == f"max_rollbacks reached (10 rollbacks in this fit); the rollbacks repeat: {cause}"
    assert judge("rollback", Facts(incident=True), Budget(True, 10, 10)).escalation == (
        "max_rollbacks reached (10 rollbacks in this fit)"
    )


def test_a_broken_data_pipeline_halts_instead_of_skipping_every_step():
    why = "batch['extra'] was flagged on 3 consecutive steps: the data pipeline is broken"
    for action in ("skip", "rollback"):
        d = judge(action, Facts(incident=True, broken=why), Budget(True, 0, 10))
        assert (d.action, d.configured, d.escalation, d.restore) == ("halt", action, why, True)
    assert judge("warn", Facts(incident=True, broken=why), Budget(True, 0, 10)).action == "warn"


def test_skip_and_warn_have_a_budget_of_bad_steps_in_a_row():
    """Under ``skip`` and ``warn`` the ``max_bad_steps``-th step in a row that went bad halts, as ``max_rollbacks``
    halts ``rollback``; a quarantined batch counts, a batch in the skip window after a rollback does not."""
    budget = Budget(True, 0, 10, bad_steps=9, max_bad_steps=10)
    for action in ("skip", "warn"):
        d = judge(action, Facts(incident=True), budget)
        assert (d.action, d.configured, d.restore) == ("halt", action, True)
        assert d.escalation.startswith("10 steps in a row went bad") and "recovery.max_bad_steps=10" in d.escalation
        assert judge(action, Facts(incident=True), Budget(True, 0, 10, bad_steps=8, max_bad_steps=10)).action == action
        assert judge(action, Facts(incident=True), Budget(True, 0, 10, bad_steps=99, max_bad_steps=0)).action == action
    quarantined = judge("skip", Facts(forced_skip=True, quarantined=True), budget)
    assert quarantined.action == "halt" and quarantined.counts == {"skipped_steps": 1}
    assert judge("skip", Facts(forced_skip=True), budget).action == "skip"  # the window after a rollback
    assert judge("rollback", Facts(incident=True), budget).action == "rollback"  # max_rollbacks is its budget


def test_the_same_trouble_a_third_time_at_the_same_place_halts_instead_of_rolling_back():
    said = "nonfinite_param at `net.0.weight` at LR schedule position 5"
    d = judge("rollback", Facts(incident=True, state_bad=True), Budget(True, 2, 10, same_place=2, same_place_said=said))
    assert d.action == "halt" and d.escalation == f"{said} came back after 2 rollbacks: a third would loop"
    assert judge("rollback", Facts(incident=True), Budget(True, 1, 10, same_place=1)).action == "rollback"
    assert judge("skip", Facts(incident=True), Budget(True, 0, 10, same_place=2)).action == "skip"  # nothing restored


def test_device_faults_on_one_rank_halt_with_the_node_named():
    fault = {"verdict": "this_rank", "rank": 3, "host": "node7", "device": "cuda:3"}
    budget = Budget(True, 0, 10, device_faults=3, max_device_faults=3)
    d = judge("rollback", Facts(incident=True, device_fault=fault), budget)
    assert d.action == "halt" and d.hardware == {"rank": 3, "host": "node7", "device": "cuda:3", "faults": 3}
    assert d.escalation.startswith("3 device faults on rank 3 (host node7, device cuda:3")
    fewer = Budget(True, 0, 10, device_faults=2, max_device_faults=3)
    assert judge("rollback", Facts(incident=True, device_fault=fault), fewer).hardware is None
    never = Budget(True, 0, 10, device_faults=50, max_device_faults=0)
    assert judge("skip", Facts(incident=True, device_fault=fault), never).action == "skip"
    assert judge("rollback", Facts(incident=True), budget).hardware is None  # not a device fault


def test_the_place_of_the_trouble_goes_with_the_decision():
    place = object()
    assert judge("rollback", Facts(incident=True, place=place), OK).place is place
    assert judge("rollback", Facts(incident=True, place=place, late=True), OK).place is place


@pytest.mark.parametrize("action", ["warn", "skip", "rollback", "halt"])
@pytest.mark.parametrize(("due", "late"), [(False, False), (True, False), (False, True), (True, True)])
def test_a_clean_steps_decision_depends_on_nothing_but_due_and_late(action, due, late):
    """The premise of judging a clean step once per fit (``StepPipeline._clean``): whatever the budget, the same
    decision, with nothing to count and nothing to carry out."""
    budgets = [
        Budget(False, 0, 3),
        Budget(True, 3, 3, repeating="the same loss", same_place=2, same_place_said="step 7"),
        Budget(True, 1, 3, bad_steps=4, max_bad_steps=5, device_faults=2, max_device_faults=2),
    ]
    for quarantine in (True, False):
        for retry in (True, False):
            decisions = [
                judge(action, Facts(snapshot_due=due, late=late), b, quarantine=quarantine, retry=retry)
                for b in budgets
            ]
            decision = decisions[0]
            assert all(d == decision for d in decisions)
            assert decision.action == "none"
            assert not decision.counts
            assert decision.keep_start == (due or late)
            assert decision.on_device == late
