"""ModelParallelStrategy with real processes (gloo, CPU): FSDP2, tensor parallel and 2-D, through local shards.

The library's own checks of issue 17 (the acceptance tests are test_sharded.py). The fits run in the one launch of
their world size (``launches.py``, ``sharded_lib_script.py``); a NaN is written into one rank's local shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.doors.trainer.launches import Launch

#: the world size of each layout: the layouts of one world size run in the same launch (``launches.py``)
WORLD = {"fsdp": 2, "tp": 2, "2d": 4}


def results(run: Launch, layout: str) -> tuple[Path, dict[str, list[dict]]]:
    """The folder of ``layout``'s scenarios, and every rank's result of each (a missing one fails with the launch's
    output)."""
    root = run.folder("sharded_lib_script") / layout
    out = {}
    for s in SCENARIOS[layout]:
        paths = [root / s / f"rank{r}.json" for r in range(WORLD[layout])]
        assert all(p.exists() for p in paths), f"{layout}/{s} wrote no result\n{run.output()}"
        out[s] = [json.loads(p.read_text()) for p in paths]
    return root, out


def weights(root: Path, scenario: str) -> dict[str, torch.Tensor]:
    return torch.load(root / scenario / "weights.pt")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def in_step(ranks: list[dict], steps: int, raised: bool = False) -> None:
    for r in ranks:
        assert r["finite"] and r["same_as_rank0"] and r["global_step"] == steps, r
        assert bool(r["raised"]) == raised, r["raised"]  # a halt raises NonFiniteError on every rank
    assert all(r["events"] == ranks[0]["events"] for r in ranks)  # every rank recorded the same


#: fits per launch: FSDP2 runs every scenario; tensor parallel and 2-D the main ones (4 ranks on 2 cores are slow)
SCENARIOS = {
    "fsdp": [
        "plain",
        "clean",
        "param",
        "twice",
        "opt_state",
        "skip",
        "omit",
        "halt",
        "resume",
        "retry",
        "accumulate",
        "async",
        "bf16",
        "end",
        "opt_state_file",
        "halt_file",
        "resume_file",
        "fused",
        "deferred_clean",
        "deferred",
        "deferred_halt",
        "warn",
    ],
    "tp": ["plain", "clean", "param", "skip", "omit", "halt", "resume"],
    "2d": ["plain", "clean", "param", "skip", "omit", "halt", "resume"],
}


@pytest.mark.ddp
@pytest.mark.parametrize("layout", ["fsdp", "tp", "2d"])
def test_every_action_on_local_shards(launched, layout):
    tmp_path, out = results(launched(WORLD[layout]), layout)
    # a clean run with the defaults ends bitwise where the guard-free run does
    assert not out["clean"][0]["events"] and same(weights(tmp_path, "plain"), weights(tmp_path, "clean"))
    # with the flags of the local shards in the one all-reduced read: one host read per step on every rank
    assert all(r["reads_per_step"] == [1] * 5 for r in out["clean"]), [r["reads_per_step"] for r in out["clean"]]
    # a NaN written into rank 1's shard of body.0.weight: named with its original name and rank 1, rolled back
    ranks = out["param"]
    in_step(ranks, 5)
    first = ranks[0]["events"][0]
    assert first["kind"] == "nonfinite_param" and first["where"] == ["body.0.weight"]
    assert first["rank"] == 1 and first["step"] == 2 and first["action"] == "rollback"
    assert ranks[0]["counters"]["rollbacks"] == 1
    replayed = [e for e in ranks[0]["events"][1:] if "replay" in e["details"]]
    assert replayed and all(e["consequence_of"] == "nonfinite_param" for e in ranks[0]["events"][1:])
    for event in replayed:  # the replay blames no op: the weights were bad (or came from rank 1)
        assert event["op"] is None and event["details"]["replay"]["stage"] == "inputs", event
    # the snapshot (of step 0: no optimizer state yet) holds this rank's shards of the parameters (1/2 or 1/4 of
    # the whole, padded) and the BatchNorm buffers, which are whole on every rank
    world = len(ranks)
    for r in ranks:
        assert r["snapshot_nbytes"] == r["local_param_nbytes"] + r["buffer_nbytes"] + r["spike_nbytes"]
        assert r["local_param_nbytes"] < 1.2 * r["full_param_nbytes"] / world
    # a skip ends bitwise where a run that left the batch out does
    in_step(out["skip"], 5)
    assert out["skip"][0]["counters"]["skipped_steps"] == 1
    assert out["skip"][0]["events"][0]["kind"] == "nonfinite_input"
    assert out["skip"][0]["events"][0]["rank"] == {"fsdp": 1, "tp": 0, "2d": 2}[layout]  # dp rank 1's first rank
    assert same(weights(tmp_path, "skip"), weights(tmp_path, "omit"))
    # halt: every rank stops at the same step with a finite last_finite.ckpt folder; a resume from it continues
    in_step(out["halt"], 3, raised=True)
    assert out["halt"][0]["events"][0]["kind"] == "nonfinite_loss" and out["halt"][0]["events"][0]["op"] == "add"
    assert out["halt"][0]["checkpoints"]["last_finite.ckpt"]
    in_step(out["resume"], 5)
    assert out["resume"][0]["counters"]["skipped_steps"] == 1  # the guard's own state came back from the folder
    if layout != "fsdp":
        return
    # two rollbacks: last_finite.ckpt (a folder) replaced in place, nothing left under a temporary name
    ranks = out["twice"]
    in_step(ranks, 5)
    assert ranks[0]["counters"]["rollbacks"] == 2
    # (trace.csv: the per-step loss and gradient norm of an eventful fit, for `numguard plot`)
    assert ranks[0]["ng_files"] == ["events.jsonl", "last_finite.ckpt", "trace.csv"]
    assert ranks[0]["checkpoints"]["last_finite.ckpt"]
    # AdamW state of rank 1 poisoned after the guard's check: the checkpoint saved meanwhile holds the snapshot
    ranks = out["opt_state"]
    in_step(ranks, 5)
    kinds = [(e["kind"], e["where"], e["rank"]) for e in ranks[0]["events"]]
    assert ("nonfinite_param", ["optimizer[0].state[body.2.weight].exp_avg_sq"], 1) in kinds
    assert ("nonfinite_param", ["checkpoint"], 1) in kinds
    assert len(ranks[0]["checkpoints"]) == 6 and all(ranks[0]["checkpoints"].values()), ranks[0]["checkpoints"]
    # retry (every rank re-runs the batch: FSDP2's backward is collective; before, the ranks hung), back-off, skip
    ranks = out["retry"]
    in_step(ranks, 5)
    first = ranks[0]["events"][0]
    assert first["kind"] == "nonfinite_input" and first["rank"] == 1 and first["details"]["quarantined"]
    assert first["details"]["retry"] == "persistent: non-finite again" and first["details"]["lr_after_backoff"]
    assert ranks[0]["counters"]["skipped_steps"] == 2 and "bad_batches" in ranks[0]["ng_files"]
    # accumulation: the window's second micro-batch (batch 3) on rank 1, named on every rank
    ranks = out["accumulate"]
    in_step(ranks, 3)
    first = ranks[0]["events"][0]
    assert (first["kind"], first["rank"], first["step"], first["batch_idx"]) == ("nonfinite_input", 1, 1, 3)
    # asynchronous snapshots (a worker thread copies the local shards) roll back as the synchronous ones
    in_step(out["async"], 5)
    assert out["async"][0]["events"] == out["param"][0]["events"]
    assert same(weights(tmp_path, "async"), weights(tmp_path, "param"))
    # under bf16-mixed autocast: the same shard, named and rolled back on every rank
    ranks = out["bf16"]
    in_step(ranks, 5)
    first = ranks[0]["events"][0]
    assert (first["kind"], first["where"], first["rank"], first["action"]) == (
        "nonfinite_param",
        ["body.0.weight"],
        1,
        "rollback",
    )
    assert ranks[0]["counters"]["rollbacks"] == 1
    # the last step's update, poisoned on rank 1's shard after the guard's hook: the end-of-fit check rolls back
    ranks = out["end"]
    in_step(ranks, 5)
    (event,) = ranks[0]["events"]
    assert (event["kind"], event["where"], event["rank"], event["action"]) == (
        "nonfinite_param",
        ["body.2.weight"],
        1,
        "rollback",
    )
    assert event["details"]["when"].startswith("at the end of training")
    # save_distributed_checkpoint=False: checkpoints are one file, whole tensors gathered by the strategy; the swap
    # and last_finite.ckpt go through the same state-dict calls, and a resume from the file continues
    ranks = out["opt_state_file"]
    in_step(ranks, 5)
    # (rank 0 holds the whole checkpoint here, so it is the rank named)
    assert ("nonfinite_param", ["checkpoint"], 0) in [(e["kind"], e["where"], e["rank"]) for e in ranks[0]["events"]]
    assert len(ranks[0]["checkpoints"]) == 6 and all(ranks[0]["checkpoints"].values()), ranks[0]["checkpoints"]
    in_step(out["halt_file"], 3, raised=True)
    assert out["halt_file"][0]["checkpoints"] == {"last_finite.ckpt": True}
    assert (tmp_path / "halt_file" / "ng" / "last_finite.ckpt").is_file()
    in_step(out["resume_file"], 5)
    assert out["resume_file"][0]["counters"]["skipped_steps"] == 1
    # sync_mode="deferred" (a fused AdamW skips on the device): clean, bitwise the guard-free run; a NaN in rank 1's
    # shard is read a step late and rolled back; a halt stops every rank at the same (late) step
    assert not out["deferred_clean"][0]["events"] and same(
        weights(tmp_path, "fused"), weights(tmp_path, "deferred_clean")
    )
    assert all(r["reads_per_step"] == [0] * 5 for r in out["deferred_clean"])  # no host read on any step
    ranks = out["deferred"]
    in_step(ranks, 5)
    first = ranks[0]["events"][0]
    assert (first["kind"], first["where"], first["rank"], first["step"]) == ("nonfinite_param", ["body.0.weight"], 1, 2)
    assert ranks[0]["counters"]["rollbacks"] == 1
    in_step(out["deferred_halt"], 4, raised=True)
    assert out["deferred_halt"][0]["events"][0]["kind"] == "nonfinite_loss"
    assert out["deferred_halt"][0]["checkpoints"]["last_finite.ckpt"]
    # action="warn" (before: both ranks crashed in on_train_start, `.tolist()` on a DTensor): recorded, not restored
    ranks = out["warn"]
    assert all(r["global_step"] == 5 and not r["finite"] for r in ranks)  # the NaN spread: nothing was restored
    first = ranks[0]["events"][0]
    assert (first["kind"], first["where"], first["rank"], first["action"]) == (
        "nonfinite_param",
        ["body.0.weight"],
        1,
        "warn",
    )
    assert ranks[0]["counters"]["rollbacks"] == 0 and ranks[0]["events"] == ranks[1]["events"]
