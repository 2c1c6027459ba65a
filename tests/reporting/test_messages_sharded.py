"""Event sentences for what a replay under sharding finds: a NaN from another rank, or no replay at all."""

from __future__ import annotations

from lightning_numguard.reporting.messages import incident_message


def test_a_nan_that_arrived_through_a_collective_blames_no_op_on_this_rank():
    replay = {"forward_module": "body.2", "stage": "inputs", "first_bad_op": "all_reduce", "from_another_rank": True}
    text = incident_message("nonfinite_output", ["body.2"], {"replay": replay}, step=2, rank=0)
    assert text.startswith("module `body.2` produced the first non-finite output at step 2 on rank 0; its values came")
    assert "from another rank through `all_reduce`, so no op on this rank is to blame" in text


def test_a_replay_that_could_not_run_says_so_and_keeps_the_watched_module():
    replay = {"error": "RuntimeError: boom"}
    text = incident_message("nonfinite_output", ["body.0"], {"replay": replay}, step=3, rank=1)
    assert "module `body.0` produced the first non-finite output at step 3 on rank 1" in text
    assert "the replay could not run (RuntimeError: boom), so the module is named from the step's flags" in text
