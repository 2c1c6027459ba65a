"""Findings: causal order within a step, merging across ranks, and the marking of consequences."""

from __future__ import annotations

import pytest

from lightning_numguard.diagnose.findings import AFTER_FORWARD, Finding, causal_position, mark_consequences, merge
from lightning_numguard.reporting.events import KINDS


def test_causal_position_follows_kinds_and_puts_forward_poisoned_buffers_last():
    positions = [causal_position(Finding(kind, ["x"])) for kind in KINDS]
    # strictly increasing (a check registered in this process, extra_checks, takes its place between them)
    assert positions == sorted(set(positions)) and len(positions) == len(KINDS)
    buffers = Finding("nonfinite_param", ["bn.running_var"], {"when": AFTER_FORWARD})
    before = Finding("nonfinite_param", ["w"], {"when": "before the optimizer step"})
    assert causal_position(buffers) > causal_position(Finding("nonfinite_grad", ["w"]))
    assert causal_position(before) < causal_position(Finding("nonfinite_output", ["m"]))
    assert causal_position(Finding("made_up", [])) > causal_position(buffers)


# each rank's findings (kind, where, rank) -> the merged order
MERGES = [
    (
        [[("nonfinite_loss", ["loss"], 0)], [("nonfinite_input", ["batch['x']"], 1)]],
        [("nonfinite_input", 1), ("nonfinite_loss", 0)],
    ),
    (  # the same finding on two ranks is kept once, for the lower rank
        [[("nonfinite_grad", ["w"], 0)], [("nonfinite_grad", ["w"], 1)]],
        [("nonfinite_grad", 0)],
    ),
    (  # module outputs keep their execution order (a stable sort)
        [[("nonfinite_output", ["b"], 0), ("nonfinite_output", ["a"], 0)]],
        [("nonfinite_output", 0), ("nonfinite_output", 0)],
    ),
    (  # same kind on several ranks: by rank
        [[("op_domain", ["gather"], 1)], [("op_domain", ["embedding"], 0)]],
        [("op_domain", 0), ("op_domain", 1)],
    ),
]


@pytest.mark.parametrize(("parts", "expected"), MERGES)
def test_merge(parts, expected):
    merged = merge([[Finding(k, list(w), {}, r) for k, w, r in part] for part in parts])
    assert [(f.kind, f.rank) for f in merged] == expected


def test_stable_order_within_a_kind():
    merged = merge([[Finding("nonfinite_output", ["b"], {}, 0), Finding("nonfinite_output", ["a"], {}, 0)]])
    assert [f.where for f in merged] == [["b"], ["a"]]


def test_an_output_that_came_from_another_rank_follows_its_source():
    """Tensor parallel: rank 1's module went NaN; a row-wise all-reduce carried it into rank 0's next module, whose
    replay says so. The source (rank 1) is first, though rank 0 is lower."""
    carried = Finding("nonfinite_output", ["fc2"], {"replay": {"from_another_rank": True}}, 0)
    source = Finding("nonfinite_output", ["act"], {"replay": {"op": "mul"}}, 1)
    assert [f.where for f in merge([[carried], [source]])] == [["act"], ["fc2"]]


def test_every_finding_after_the_first_names_it_as_the_cause():
    found = [
        Finding("nonfinite_input", ["batch['x']"]),
        Finding("nonfinite_loss", ["loss"]),
        Finding("nonfinite_grad", []),
    ]
    found = mark_consequences(found)
    assert "after" not in found[0].details
    assert found[1].details["after"] == found[2].details["after"] == "nonfinite_input in `batch['x']`"


def test_a_lone_finding_is_no_consequence():
    found = [Finding("nonfinite_loss", ["loss"])]
    found = mark_consequences(found)
    assert found[0].details == {}


def test_an_existing_cause_is_kept():
    found = [Finding("nonfinite_input", []), Finding("nonfinite_loss", ["loss"], {"after": "something earlier"})]
    found = mark_consequences(found)
    assert found[0].details == {} and found[1].details["after"] == "something earlier"
