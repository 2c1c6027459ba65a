"""Real ``ModelParallelStrategy`` runs: FSDP2 (2 ranks), tensor parallel (2 ranks) and 2-D (4 ranks), gloo on the CPU.

The scenarios run in the one launch of their world size (2: FSDP2 and tensor parallel; 4: 2-D; ``launches.py``), in
sequence (``sharded_script.py``); each test reads the per-rank results of the scenarios it compares. Faults are on global rank 1 at global step 2 (see the script's docstring):
a NaN in rank 1's local shard of ``fc1.weight``, a NaN output of ``act`` on rank 1, NaN inputs in data-parallel
rank 1's batch 2. ``omit`` is a guard-free run whose data left batch 2 out on every data-parallel rank (``omit12``:
batches 1 and 2): a step-2 skip, or a rollback of an output fault to the snapshot taken at step 2's read, is exact
when the run ends bitwise where ``omit`` ends; a shard fault poisons the state at the start of step 2, so its
rollback restores the snapshot of step 1 (the state after batch 0) and ends where ``omit12`` ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.doors.trainer.launches import Launch

WORLD = {"fsdp2": 2, "tp": 2, "2d": 4}
#: the scenarios of each layout; the layouts of one world size run in one launch (a process costs seconds of
#: imports, a fit of the tiny model about one)
SCENARIOS = {
    "fsdp2": "plain,clean,shard,warn,output,skip,omit,omit12,halt,resume",
    "tp": "plain,clean,shard,output,omit,omit12",
    "2d": "plain,clean,shard,output,omit,omit12,halt,resume",
}

Results = Callable[[str, str], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def sharded(launched: Callable[[int], Launch]) -> Results:
    """``sharded(layout, scenario)``: every rank's result of that scenario, from the launch of its world size."""

    def results(layout: str, scenario: str) -> list[dict[str, Any]]:
        world = WORLD[layout]
        run = launched(world)
        root = run.folder("sharded_script") / layout
        ranks = []
        for r in range(world):
            path = root / scenario / f"rank{r}.json"
            assert path.exists(), f"{layout}/{scenario}: rank {r} wrote no result\n{run.output()}"
            result = json.loads(path.read_text())
            halted = scenario == "halt" and "NonFiniteError: NumGuard halted training" in result.get("error", "")
            assert "error" not in result or halted, f"{layout}/{scenario} raised on rank {r}:\n{result['error']}"
            ranks.append(result)
        return ranks

    return results


def assert_same_on_every_rank(ranks: list[dict[str, Any]], *keys: str) -> None:
    for key in keys:
        assert all(r[key] == ranks[0][key] for r in ranks), (key, [r[key] for r in ranks])


def assert_bitwise(ranks: list[dict[str, Any]], other: list[dict[str, Any]]) -> None:
    """The full gathered weights and AdamW state are bitwise those of ``other``, on every rank."""
    for r, o in zip(ranks, other):
        assert (r["digest"], r["opt_digest"]) == (o["digest"], o["opt_digest"]), r["rank"]


def assert_clean_is_guard_free(sharded: Results, layout: str) -> None:
    clean, plain = sharded(layout, "clean"), sharded(layout, "plain")
    for r in clean:
        assert r["global_step"] == 6 and r["finite"]
        assert r["events"] == [] and r["counters"]["incidents"] == 0, r["events"]
    assert_bitwise(clean, plain)
    assert_same_on_every_rank(plain, "digest", "opt_digest")


def assert_shard_rolled_back(sharded: Results, layout: str) -> None:
    """NaN in rank 1's local shard of fc1.weight at step 2: named as ``fc1.weight`` on rank 1, rolled back on every
    rank to the snapshot of step 1, and the run ends all its steps bitwise where ``omit12`` ends."""
    ranks = sharded(layout, "shard")
    assert [r["fired"] for r in ranks] == [int(r["rank"] == 1) for r in ranks]
    for r in ranks:
        assert r["global_step"] == 6 and r["finite"]
        assert r["counters"]["rollbacks"] == 1, r["counters"]
    assert_same_on_every_rank(ranks, "digest", "opt_digest", "events", "counters")
    first = ranks[0]["events"][0]
    assert (first["kind"], first["where"], first["rank"], first["step"]) == ("nonfinite_param", ["fc1.weight"], 1, 2)
    assert first["action"] == "rollback"
    assert_bitwise(ranks, sharded(layout, "omit12"))


def assert_output_named_and_replayed(sharded: Results, layout: str) -> None:
    """A NaN output of ``act`` on rank 1 at step 2: named from the output flags with rank 1; every rank took part
    in the replay (FSDP2 all-gathers in the forward), which names the op inside ``act``; rolled back like
    ``shard``."""
    ranks = sharded(layout, "output")
    for r in ranks:
        assert r["global_step"] == 6 and r["finite"] and r["counters"]["rollbacks"] == 1
    assert_same_on_every_rank(ranks, "digest", "events")
    first = ranks[0]["events"][0]
    assert (first["kind"], first["where"], first["rank"], first["step"]) == ("nonfinite_output", ["act"], 1, 2)
    replay = first["details"].get("replay") or {}
    assert (replay.get("forward_module"), replay.get("op_module"), replay.get("op")) == ("act", "act", "mul"), first
    assert_bitwise(ranks, sharded(layout, "omit"))


def assert_halted_and_resumed(sharded: Results, layout: str) -> None:
    """action="halt" on the shard fault: every rank stops at the same step with the snapshot of step 1 restored and
    saved as last_finite.ckpt (ModelParallelStrategy writes a distributed-checkpoint folder); a new fit under the
    same strategy with ``ckpt_path`` starts from exactly that state with the guard's counters and runs to the end."""
    halt, resume = sharded(layout, "halt"), sharded(layout, "resume")
    for h in halt:
        assert h["global_step"] < 6 and h["finite"]
        assert any(e["action"] == "halt" for e in h["events"]), h["events"]
        assert "NonFiniteError: NumGuard halted training" in h["error"], h.get("error")  # every rank raised
    assert_same_on_every_rank(halt, "global_step", "digest", "opt_digest", "events", "counters")
    for h, r in zip(halt, resume):
        start = r["start"]
        assert (start["digest"], start["opt_digest"]) == (h["digest"], h["opt_digest"])
        # the guard's state came along: every counter the halted run ended with, the halt's incident included
        carried = h["counters"]
        assert {k: start["counters"][k] for k in carried} == carried, start
        assert carried["skipped_steps"] == 1 and carried["incidents"] >= 1, carried
        assert 0 < start["global_step"] <= h["global_step"]
        assert r["global_step"] == 6 and r["finite"] and r["events"] == []
    assert_same_on_every_rank(resume, "digest", "opt_digest")


# ---------------------------------------------------------------------------------------------------- FSDP2


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_a_clean_run_under_the_defaults_is_bitwise_the_guard_free_run(sharded):
    assert_clean_is_guard_free(sharded, "fsdp2")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_a_nan_in_one_ranks_shard_is_rolled_back_on_every_rank_and_named_with_that_rank(sharded):
    assert_shard_rolled_back(sharded, "fsdp2")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_a_skip_ends_bitwise_where_a_run_without_that_batch_ends(sharded):
    """action="skip", NaN inputs in data-parallel rank 1's batch 2: every rank skips step 2 together."""
    ranks = sharded("fsdp2", "skip")
    for r in ranks:
        assert r["global_step"] == 6 and r["finite"]
        assert r["counters"]["skipped_steps"] == 1 and r["counters"]["rollbacks"] == 0, r["counters"]
    assert_same_on_every_rank(ranks, "events")
    first = ranks[0]["events"][0]
    assert (first["kind"], first["where"], first["rank"], first["step"]) == ("nonfinite_input", ["batch[0]"], 1, 2)
    assert_bitwise(ranks, sharded("fsdp2", "omit"))


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_warn_checks_local_shards_and_changes_nothing(sharded):
    """The regression: ``.tolist() is not supported for tensor subclasses, got DTensor`` in on_train_start."""
    ranks = sharded("fsdp2", "warn")
    for r in ranks:
        assert r["global_step"] == 6
        assert not r["finite"]  # nothing restored: the NaN spread through the updates
        assert r["counters"]["rollbacks"] == 0 and r["counters"]["skipped_steps"] == 0
    assert_same_on_every_rank(ranks, "events")
    first = ranks[0]["events"][0]
    assert (first["kind"], first["where"], first["rank"], first["step"]) == ("nonfinite_param", ["fc1.weight"], 1, 2)
    assert first["action"] == "warn"


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_the_replay_runs_on_every_rank_and_names_the_op(sharded):
    assert_output_named_and_replayed(sharded, "fsdp2")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_halt_saves_last_finite_through_the_strategy_and_fit_resumes_from_it(sharded):
    assert_halted_and_resumed(sharded, "fsdp2")


# ---------------------------------------------------------------------------------------------------- tensor parallel


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_tp_a_clean_run_under_the_defaults_is_bitwise_the_guard_free_run(sharded):
    assert_clean_is_guard_free(sharded, "tp")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_tp_a_nan_in_one_ranks_shard_is_rolled_back_on_every_rank_and_named_with_that_rank(sharded):
    assert_shard_rolled_back(sharded, "tp")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_tp_the_replay_runs_on_every_rank_and_names_the_op(sharded):
    assert_output_named_and_replayed(sharded, "tp")


# ---------------------------------------------------------------------------------------------------- 2-D


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_2d_a_clean_run_under_the_defaults_is_bitwise_the_guard_free_run(sharded):
    assert_clean_is_guard_free(sharded, "2d")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_2d_a_nan_in_one_ranks_shard_is_rolled_back_on_every_rank_and_named_with_that_rank(sharded):
    assert_shard_rolled_back(sharded, "2d")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_2d_the_replay_runs_on_every_rank_and_names_the_op(sharded):
    assert_output_named_and_replayed(sharded, "2d")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_2d_halt_saves_last_finite_through_the_strategy_and_fit_resumes_from_it(sharded):
    assert_halted_and_resumed(sharded, "2d")
