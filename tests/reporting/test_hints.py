"""Tests of ``lightning_numguard.reporting.hints``: every kind, op and code has its words, and a
live message and ``numguard explain`` give the same advice for the same event."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_numguard.detect.coverage import COVERAGE_CODES, NO_GRAD_IN_FIRST_STEP
from lightning_numguard.detect.opguard import GUARDED_OPS
from lightning_numguard.reporting.events import KINDS, Event
from lightning_numguard.reporting.explain import explain
from lightning_numguard.reporting.hints import (
    COVERAGE_PROBLEMS,
    FILL_VALUES,
    KIND_HINTS,
    OP_DOMAIN_HINTS,
    coverage_hint,
    coverage_problem,
    event_hint,
    fill_value_name,
    forward_op_hint,
    kind_hint,
    op_domain_hint,
    op_hint,
    overflow_hint,
)
from lightning_numguard.reporting.messages import incident_message

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- tables


def test_every_kind_has_a_hint() -> None:
    assert set(KIND_HINTS) == set(KINDS)
    assert all(hint.strip() for hint in KIND_HINTS.values())
    assert kind_hint("nonfinite_loss") == KIND_HINTS["nonfinite_loss"]
    assert "does not describe" in kind_hint("brand_new_kind")


def test_every_guarded_op_has_a_hint() -> None:
    assert set(OP_DOMAIN_HINTS) == GUARDED_OPS
    assert all(hint.strip() for hint in OP_DOMAIN_HINTS.values())
    assert "BCEWithLogitsLoss" in (op_domain_hint("binary_cross_entropy") or "")
    assert op_domain_hint("not_an_op") is None


def test_every_coverage_code_has_a_problem_and_a_hint() -> None:
    assert set(COVERAGE_PROBLEMS) == set(COVERAGE_CODES)
    for code in COVERAGE_CODES:
        problem, hint = coverage_problem(code)
        assert problem.strip() and hint.strip(), code
        assert coverage_hint(code) == hint
    with pytest.raises(KeyError):
        coverage_problem("no_such_code")


def test_coverage_texts_are_the_callbacks() -> None:
    assert (
        coverage_problem("frozen_in_optimizer")[0] == "frozen parameters (requires_grad=False) handed to an optimizer"
    )
    assert coverage_problem(NO_GRAD_IN_FIRST_STEP) == (
        "trainable parameters that received no gradient in the first step",
        "they are unused in the forward pass (or detached): freeze them or remove them from the optimizer; "
        "under DDP also set find_unused_parameters",
    )


@pytest.mark.parametrize(
    ("op", "needle"),
    [("SqrtBackward0", "eps inside the root"), ("DivBackward12", "std + 1e-8"), ("LogBackward", "log")],
)
def test_op_hint_ignores_the_node_number(op: str, needle: str) -> None:
    assert needle in (op_hint(op) or "")


def test_op_hint_of_an_unknown_node_is_none() -> None:
    assert op_hint("MyFuncBackward0") is None


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (1e20, "numpy's masked-array default fill value 1e20"),
        (-1.0000000200408773e20, "numpy's masked-array default fill value 1e20"),  # float32(1e20), negated
        (9.969209968386869e36, "netCDF's default float fill value 9.96921e36"),
        (1.0, None),
        (1e19, None),
        (float("inf"), None),
        (float("nan"), None),
        (None, None),
        ("inf", None),  # a value read back from events.jsonl
    ],
)
def test_fill_value_name(value: Any, name: str | None) -> None:
    assert fill_value_name(value) == name
    assert name is None or name in FILL_VALUES


# --------------------------------------------------------------------------- one event, one hint

#: (kind, where, details): an event of every kind, and each way a hint can be more specific.
EVENTS: list[tuple[str, list[str], dict[str, Any]]] = [
    ("optimizer_coverage", ["body.0.weight"], {"problem": "frozen parameters", "hint": "freeze them properly"}),
    ("optimizer_coverage", ["body.0.weight"], {}),
    ("nonfinite_input", ["batch['x']"], {"stats": {"nan": 2, "posinf": 0, "neginf": 0}}),
    ("suspicious_input", ["batch['x']"], {"max_abs": 1e20}),
    ("suspicious_input", ["batch['x']"], {"max_abs": 3e12}),
    ("nonfinite_param", ["body.0.weight"], {"when": "before the optimizer step"}),
    ("nonfinite_param", ["body.1.running_var"], {"when": "after the forward pass", "after": "nonfinite_input"}),
    ("nonfinite_output", ["norm"], {"replay": {"forward_op": "div", "forward_op_module": "norm"}}),
    ("nonfinite_output", ["head"], {"after": "nonfinite_input"}),
    ("op_domain", ["binary_cross_entropy"], {"op": "binary_cross_entropy", "rule": "input in [0, 1]", "count": 3}),
    ("op_domain", ["nll_loss"], {"op": "nll_loss", "rule": "target in [0, C)", "upstream": "body.1"}),
    ("op_domain", ["embedding"], {"op": "embedding", "hint": "a hint of the op guard's own"}),
    ("op_domain", ["mystery_op"], {"op": "mystery_op"}),
    ("nonfinite_loss", ["loss"], {}),
    ("nonfinite_loss", ["loss"], {"after": "nonfinite_output"}),
    ("nonfinite_grad", ["norm.weight"], {"replay": {"op": "SqrtBackward0", "module": "norm"}}),
    ("nonfinite_grad", ["norm.weight"], {"replay": {"op": "MyFuncBackward0"}}),
    ("nonfinite_grad", ["norm.weight"], {"replay": {"op": "SqrtBackward0"}, "after": "nonfinite_input"}),
    ("nonfinite_grad", ["head.weight"], {}),
]


@pytest.mark.parametrize(("kind", "where", "details"), EVENTS)
def test_live_message_and_explain_give_the_same_hint(
    tmp_path: Path, kind: str, where: list[str], details: dict[str, Any]
) -> None:
    hint = event_hint(kind, details)
    assert hint.strip()
    message = incident_message(kind, where, details, step=5, rank=0)
    assert message.endswith(f"; {hint}") or message.endswith(f": {hint}"), (message, hint)

    event = Event(kind, 5, 0, 5, 0, where, "warn", message, details).to_dict()
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps(event) + "\n", encoding="utf-8")
    result = explain(path)
    shown = result.summary["first_culprit"]["hint"]
    replayed = details.get("replay", {}).get("op")
    assert shown in (hint, f"{replayed}: {hint}"), (shown, hint)
    assert " ".join(hint.split()) in " ".join(result.text.split())  # the report's "hint:" line, unwrapped


def test_specific_hints_win_over_the_kinds() -> None:
    assert event_hint("op_domain", {"op": "nll_loss"}) == OP_DOMAIN_HINTS["nll_loss"]
    assert event_hint("op_domain", {"op": "nll_loss", "hint": "own"}) == "own"
    assert event_hint("op_domain", {"op": "mystery_op"}) == KIND_HINTS["op_domain"]
    assert event_hint("op_domain", {"op": "gather", "upstream": "enc"}) == (
        OP_DOMAIN_HINTS["gather"] + "; the input is already non-finite upstream: first non-finite module was `enc`"
    )
    assert event_hint("nonfinite_grad", {"replay": {"op": "DivBackward0"}}) == op_hint("DivBackward0")
    assert event_hint("nonfinite_output", {"replay": {"op": "DivBackward0"}}) == KIND_HINTS["nonfinite_output"]
    assert "masked-array fill value" in event_hint("suspicious_input", {"max_abs": 1e20})
    assert event_hint("optimizer_coverage", {"hint": "h"}) == "h"


def test_findings_after_the_root_cause_point_at_it() -> None:
    expected = "a consequence of the earlier nonfinite_input in this step: fix that first"
    for kind in ("nonfinite_output", "nonfinite_loss", "nonfinite_grad"):
        assert event_hint(kind, {"after": "nonfinite_input"}) == expected
    assert event_hint("nonfinite_param", {"after": "nonfinite_input", "when": "after the forward pass"}) == expected
    # a root cause of its own keeps its own hint
    assert event_hint("nonfinite_param", {"after": "nonfinite_input"}) == KIND_HINTS["nonfinite_param"]
    assert event_hint("suspicious_input", {"after": "x"}) == KIND_HINTS["suspicious_input"]


def test_op_domain_message_takes_the_op_hint_when_details_have_none() -> None:
    details = {"op": "one_hot", "rule": "labels in [0, num_classes)", "count": 1, "min": -1, "max": -1}
    message = incident_message("op_domain", ["one_hot"], details, step=2, rank=1)
    assert message == (
        "`one_hot` got inputs outside its domain (labels in [0, num_classes)) at step 2 on rank 1: "
        f"1 bad values (min -1, max -1); {OP_DOMAIN_HINTS['one_hot']}"
    )


def test_op_domain_message_says_no_none() -> None:
    """Before (issue 20): "8 bad values, min None, max None" when every bad value was NaN."""
    details = {"op": "binary_cross_entropy", "rule": "input in [0, 1]", "count": 8, "nan_count": 8}
    message = incident_message("op_domain", ["binary_cross_entropy"], {**details, "min": None, "max": None}, 6, 0)
    assert ": 8 bad values (8 NaN);" in message and "None" not in message
    mixed = incident_message("op_domain", ["binary_cross_entropy"], {**details, "min": 1.5, "max": 2.5}, 6, 0)
    assert ": 8 bad values (8 NaN, min 1.5, max 2.5);" in mixed


def test_a_kind_this_version_does_not_know_gets_no_hint() -> None:
    assert incident_message("brand_new_kind", ["x"], {}, step=1, rank=0) == "brand_new_kind in `x` at step 1 on rank 0"


def test_reading_hints_and_explaining_never_imports_torch() -> None:
    code = (
        "import sys, lightning_numguard.cli, lightning_numguard.reporting.hints, "
        "lightning_numguard.reporting.messages, lightning_numguard.reporting.explain; "
        "sys.exit('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("replay", "expected"),
    [
        ({"stage": "forward", "op": "matmul", "dtype": "float16", "max_abs_in": 1800.0}, "overflowed float16"),
        ({"stage": "forward", "op": "linear", "dtype": "float32", "max_abs_in": 5e34}, "learning rate"),
        ({"stage": "forward", "op": "linear", "dtype": "float16", "max_abs_in": 5e34}, "learning rate"),
        ({"stage": "forward", "op": "div", "dtype": "float32", "max_abs_in": 3.0}, None),  # a plain 0/0
        ({"stage": "forward", "op": "exp", "dtype": "bfloat16", "max_abs_in": 100.0}, None),
        ({"stage": "backward", "op": "SqrtBackward0", "max_abs_in": 5e34}, None),
        ({"stage": "forward", "op": "log"}, None),  # an older event without the facts
    ],
)
def test_overflow_hint(replay: dict, expected: str | None) -> None:
    hint = overflow_hint(replay)
    assert (hint is None) if expected is None else (hint is not None and expected in hint), hint
    shown = event_hint("nonfinite_output", {"replay": replay})
    # without an overflow to explain, the op's own advice (``div``, ``exp``, ``log`` have one), else the kind's
    own = forward_op_hint(replay) or event_hint("nonfinite_output", {})
    assert (expected in shown) if expected else shown == own
