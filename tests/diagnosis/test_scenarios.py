"""The guard names the true culprit's kind, op and the user's line in every fault scenario."""

from __future__ import annotations

import pytest

from instruments.diagnosis.scenarios import CASES, Case, message_holds, run_guarded


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_first_culprit_and_op(case: Case, tmp_path):
    event = run_guarded(case, str(tmp_path))["event"]
    assert event, f"{case.name}: the guard found nothing"
    assert (event["kind"], event.get("op")) == (case.kind, case.op), event["message"]
    if case.module is not None:
        assert event.get("module") == case.module, event["message"]
    if case.op is not None and event["kind"] != "optimizer_coverage":
        assert (event.get("source") or "").split(":")[0].endswith("scenarios.py"), event.get("source")
    assert message_holds(event), event["message"]
    if case.hint is not None:
        assert case.hint in event["message"], event["message"]
