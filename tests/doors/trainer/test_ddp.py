"""Real DDP: two gloo processes on the CPU, a fault on one rank only (``ddp_script.py``, in the launch of 2 ranks)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.doors.trainer.launches import Launch

#: Every fit of this file, each into its own folder, in the one launch of 2 ranks (``launches.py``: starting processes
#: costs more than most fits); the halting one goes last, so that the launch ends with its NonFiniteError.
PACK = {
    "input": "input:1:rollback",
    "param": "param:1:rollback",
    "op": "op:1:skip",
    "accumulate": "accumulate:1:rollback",
    "manual": "manual:1:rollback",
    "sharded": "sharded:1:rollback",
    "sharded_async": "sharded_async:1:rollback",
    "deferred_sharded": "deferred_sharded:1:rollback",
    "bf16_64": "input,accumulate,manual:1:rollback:bf16-mixed,64-true",
    "fp16": "input,grad,accumulate,manual,compile:1:rollback:16-mixed",
    "spike": "spike:1:rollback",
    "loss_halt": "loss:0:halt",
}


@dataclass
class Pack:
    root: Path
    proc: subprocess.CompletedProcess[str]

    def __call__(self, name: str) -> Path:
        """The folder of fit ``name``; fails with the launch's output when the fit wrote nothing (an earlier one
        crashed the launch)."""
        out = self.root / name
        written = list(out.rglob("rank*.json")) + list(out.glob("*.pt"))
        assert written, (
            f"{name} wrote nothing: exit {self.proc.returncode}\n{self.proc.stdout[-2000:]}\n{self.proc.stderr[-4000:]}"
        )
        return out

    def ranks(self, name: str) -> list[dict]:
        return ranks_of(self(name))


@pytest.fixture(scope="module")
def pack(launched: Callable[[int], Launch]) -> Pack:
    run = launched(2)
    # the DDP pack goes last in the launch and its last fit halts: NonFiniteError on every rank ends the launch
    assert run.proc.returncode != 0 and "NonFiniteError: NumGuard halted training" in run.proc.stderr, run.output()
    return Pack(run.folder("ddp_script"), run.proc)


@pytest.mark.ddp
def test_input_fault_on_rank_1_rolls_back_every_rank_together(pack):
    ranks = pack.ranks("input")
    for r in ranks:
        assert r["finite"] and r["same_as_rank0"]
        assert r["counters"]["rollbacks"] == 1 and r["counters"]["skipped_steps"] == 1
        assert r["global_step"] == 5
    # every rank has the same record, naming the rank that saw the bad batch
    assert ranks[0]["events"] == ranks[1]["events"]
    first = ranks[0]["events"][0]
    assert first["kind"] == "nonfinite_input" and first["rank"] == 1 and first["step"] == 2
    assert first["where"] == ["batch['x']"]
    # rank 0 alone writes the file, once
    lines = (pack("input") / "ng" / "events.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == ranks[0]["events"]


@pytest.mark.ddp
def test_a_weight_one_rank_made_nan_is_named_with_that_rank(pack):
    """DDP all-reduces the gradients, so every rank's gradient flag is set; the weight was NaN on rank 1 alone."""
    ranks = pack.ranks("param")
    for r in ranks:
        assert r["finite"] and r["same_as_rank0"]
        assert r["counters"]["rollbacks"] == 1
    assert ranks[0]["events"] == ranks[1]["events"]
    first = ranks[0]["events"][0]
    assert first["kind"] == "nonfinite_param" and first["where"] == ["body.0.weight"], first
    assert first["rank"] == 1 and first["step"] == 2


@pytest.mark.ddp
def test_loss_fault_on_rank_0_halts_every_rank(pack):
    ranks = pack.ranks("loss_halt")  # the launch exits non-zero (the fixture holds it)
    for r in ranks:
        assert r["finite"] and r["same_as_rank0"]
        assert r["global_step"] == 3  # stopped together after the bad step
        # every rank raised at the same step (the report's all_gather in on_exception needs both)
        assert r["raised"].startswith("NonFiniteError: NumGuard halted training at step 2"), r["raised"]
        assert "ckpt_path=" in r["raised"]
    assert ranks[0]["events"][0]["kind"] == "nonfinite_loss" and ranks[0]["events"][0]["rank"] == 0
    assert (pack("loss_halt") / "ng" / "last_finite.ckpt").exists()


@pytest.mark.ddp
def test_op_domain_on_rank_1_is_defused_and_ranks_stay_in_step(pack):
    ranks = pack.ranks("op")
    for r in ranks:
        assert r["finite"] and r["same_as_rank0"]
        assert r["counters"]["skipped_steps"] == 1
        assert r["global_step"] == 5
    (event,) = ranks[0]["events"]
    assert event["kind"] == "op_domain" and event["rank"] == 1 and event["step"] == 2
    assert event["where"] == ["binary_cross_entropy"]


@pytest.mark.ddp
def test_accumulation_fault_in_one_micro_batch_of_rank_1(pack):
    """accumulate 2: batch 3 (window 1's second micro-batch) is NaN on rank 1 only. Every rank decides together
    at the window's step, and the event names rank 1 and batch 3 on every rank (before: rank 0 said batch 2)."""
    ranks = pack.ranks("accumulate")
    for r in ranks:
        assert r["finite"] and r["same_as_rank0"]
        assert r["counters"]["rollbacks"] == 1 and r["counters"]["skipped_steps"] == 1
        assert r["global_step"] == 3  # 5 batches, windows of 2: 3 optimizer steps in the epoch
    assert ranks[0]["events"] == ranks[1]["events"]
    first = ranks[0]["events"][0]
    assert first["kind"] == "nonfinite_input" and first["rank"] == 1 and first["step"] == 1
    assert first["batch_idx"] == 3 and first["where"] == ["batch['x']"]


@pytest.mark.ddp
def test_manual_two_optimizers_fault_on_rank_1_ranks_stay_in_step(pack):
    """A GAN under manual optimization; its discriminator loss is NaN at batch 2 on rank 1 only."""
    ranks = pack.ranks("manual")
    for r in ranks:
        assert r["finite"] and r["same_as_rank0"]
        assert r["counters"]["skipped_steps"] == 1
        # a guard-free run takes two optimizer steps per batch: 5 batches, 10 steps
        # (tests/doors/trainer/test_setups_accumulation.py compares with one)
        assert r["global_step"] == 10
    assert ranks[0]["events"] == ranks[1]["events"]
    first = ranks[0]["events"][0]
    assert first["kind"] == "nonfinite_loss" and first["rank"] == 1 and first["batch_idx"] == 2
    assert first["step"] == 5  # the discriminator's optimizer step of batch 2
    # the default replay ran on rank 1 (stepping no optimizer, moving no counter) and named the op
    assert "`mul` at" in first["message"] and "test_setups_accumulation.py" in first["message"]
    assert ranks[0]["counters"]["rollbacks"] == 1


def _bitwise(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bitwise(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.ddp
def test_sharded_snapshots_hold_half_per_rank_and_restore_bitwise_like_full_copies(pack):
    """snapshot_sharding="auto" vs "off", the same faulty run (AdamW state NaN on rank 1 at step 3, a snapshot every
    2 steps, a checkpoint every step): each rank holds about half the parameter and optimizer bytes, and the
    checkpoint swap and the rollback (both gather from the two ranks) give bitwise the weights, buffers and AdamW
    state of full copies (buffers, which differ per rank, are kept whole: sharding them too fails this test)."""
    import torch

    out = pack("sharded")
    load = lambda mode, r: torch.load(out / f"sharded_{mode}_rank{r}.pt", weights_only=False)  # noqa: E731
    auto, off = [load("auto", r) for r in (0, 1)], [load("off", r) for r in (0, 1)]
    for r in (0, 1):
        a, o = auto[r], off[r]
        assert a["counters"]["rollbacks"] == 1 and a["counters"] == o["counters"]
        assert a["events"] == o["events"]
        assert any(e["where"] == ["checkpoint"] for e in a["events"])  # the swap ran
        assert _bitwise(a["state"], o["state"]) and _bitwise(a["optimizer"], o["optimizer"])
        assert all(torch.isfinite(t).all() for t in a["state"].values() if t.is_floating_point())
        # about 1/2 of the parameters and AdamW state per rank (the rest: buffers, scheduler, metric, RNG)
        assert o["sharded_nbytes"] == 0 and 0 < a["sharded_nbytes"] <= o["snapshot_nbytes"] / 2
        assert a["snapshot_nbytes"] < 0.6 * o["snapshot_nbytes"], (a["snapshot_nbytes"], o["snapshot_nbytes"])
    assert auto[0]["checkpoints"].keys() == off[0]["checkpoints"].keys() and auto[0]["checkpoints"]
    assert _bitwise(auto[0]["checkpoints"], off[0]["checkpoints"])
    print({f"rank{r}": {k: v[r][f"{k}_nbytes"] for k, v in (("snapshot", auto), ("sharded", auto))} for r in (0, 1)})
    print({"off": [o["snapshot_nbytes"] for o in off]})


@pytest.mark.ddp
def test_asynchronous_sharded_snapshots_restore_bitwise_like_synchronous_full_copies(pack):
    """The sharded run above with snapshot_async=True (each rank's slices copied by a worker thread from batch start
    on): the checkpoint swap and the rollback still give bitwise the weights, buffers and AdamW state of synchronous
    full copies."""
    import torch

    out = pack("sharded_async")
    load = lambda mode, r: torch.load(out / f"sharded_{mode}_rank{r}.pt", weights_only=False)  # noqa: E731
    for r in (0, 1):
        a, o = load("auto", r), load("off", r)
        assert a["counters"]["rollbacks"] == 1 and a["counters"] == o["counters"] and a["events"] == o["events"]
        assert any(e["where"] == ["checkpoint"] for e in a["events"])  # the swap gathered the asynchronous snapshot
        assert _bitwise(a["state"], o["state"]) and _bitwise(a["optimizer"], o["optimizer"])
        assert 0 < a["sharded_nbytes"] <= o["snapshot_nbytes"] / 2
        assert a["async"] and not o["async"]
        if r == 0:
            assert a["checkpoints"] and _bitwise(a["checkpoints"], o["checkpoints"])


def ranks_of(root: Path) -> list[dict]:
    return [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]


#: site: (kind, global step of the read, batch_idx, global_step at the end of a guard-free run)
EXPECTED = {
    "input": ("nonfinite_input", 2, 2, 5),
    "accumulate": ("nonfinite_input", 1, 3, 3),  # accumulate 2: batch 3 is window 1's second micro-batch
    "manual": ("nonfinite_loss", 5, 2, 10),  # the GAN: two optimizer steps per batch, read at the second's
    "compile": ("nonfinite_output", 3, 3, 5),  # NaN inside a compiled head
}


def assert_rolled_back_together(ranks: list[dict], site: str) -> None:
    """A fault on rank 1: every rank rolls back in the same step, names the same rank and micro-batch, and ends
    finite, identical and at a guard-free run's ``global_step``."""
    kind, step, batch_idx, global_step = EXPECTED[site]
    for r in ranks:
        assert r["finite"] and r["same_as_rank0"]
        assert r["counters"]["rollbacks"] == 1 and r["counters"]["skipped_steps"] == 1
        assert r["counters"]["amp_overflow_steps"] == 0  # a NaN is an incident, never the scaler's overflow
        assert r["global_step"] == global_step
    assert ranks[0]["events"] == ranks[1]["events"]
    first = ranks[0]["events"][0]
    assert (first["kind"], first["step"], first["batch_idx"], first["rank"]) == (kind, step, batch_idx, 1), first


@pytest.mark.ddp
def test_bf16_and_64_true_faults_on_rank_1(pack):
    """One launch, six fits in sequence: NaN inputs, NaN inputs in an accumulation window's second micro-batch,
    and a manual-optimization GAN's NaN loss (under the default replay), each under bf16-mixed and 64-true."""
    out = pack("bf16_64")
    for site in ("input", "accumulate", "manual"):
        for precision in ("bf16-mixed", "64-true"):
            assert_rolled_back_together(ranks_of(out / site / precision), site)


@pytest.mark.ddp
def test_fp16_gradscaler_faults_and_overflow_on_rank_1(pack):
    """16-mixed under a CPU GradScaler, one launch, five fits: the three faults above and a NaN inside a
    ``torch.compile``d head are incidents, rolled back on every rank; a non-finite gradient on rank 1 only
    (all-reduced to every rank) is the scaler's overflow, skipped by the scaler on every rank alike, no incident."""
    out = pack("fp16")
    for site in ("input", "accumulate", "manual", "compile"):
        assert_rolled_back_together(ranks_of(out / site / "16-mixed"), site)
    if hasattr(torch.compiler, "set_stance"):  # rank 1's replay ran the compiled head eagerly and found the op
        assert "op `log1p` in `head._orig_mod`" in ranks_of(out / "compile" / "16-mixed")[0]["events"][0]["message"]
    for r in ranks_of(out / "grad" / "16-mixed"):
        assert r["finite"] and r["same_as_rank0"]
        assert r["counters"]["amp_overflow_steps"] == 1 and r["counters"]["incidents"] == 0, r["counters"]
        assert not r["events"] and r["global_step"] == 5


@pytest.mark.ddp
def test_deferred_sync_shards_its_snapshot_ring_and_rolls_back_late_bitwise_like_full_copies(pack):
    """sync_mode="deferred", snapshot_sharding="auto" vs "off", the same faulty run (fused AdamW's exp_avg_sq NaN on
    rank 1 at step 3, a snapshot every 2 steps, a checkpoint every step, 10 steps): every snapshot the ring holds is
    about half the bytes on each rank; the checkpoint swaps and the late rollback read at step 5 gather it, and the
    final weights, buffers and AdamW state, the events, the counters and every checkpoint are bitwise those of full
    copies; a new candidate reuses the spare's slices; the guard reads nothing on the host on a clean step."""
    import torch

    out = pack("deferred_sharded")
    load = lambda mode, r: torch.load(out / f"deferred_{mode}_rank{r}.pt", weights_only=False)  # noqa: E731
    auto, off = [load("auto", r) for r in (0, 1)], [load("off", r) for r in (0, 1)]
    for r in (0, 1):
        a, o = auto[r], off[r]
        assert a["counters"]["rollbacks"] >= 1 and a["counters"] == o["counters"]
        assert a["events"] == o["events"]
        assert any(e["where"] == ["checkpoint"] for e in a["events"])  # the swap ran
        rolled = [e for e in a["events"] if e["kind"] == "nonfinite_param" and e["action"] == "rollback"]
        assert rolled and rolled[0]["details"]["read_at_step"] == 5  # the late rollback
        assert _bitwise(a["state"], o["state"]) and _bitwise(a["optimizer"], o["optimizer"])
        assert all(torch.isfinite(t).all() for t in a["state"].values() if t.is_floating_point())
        assert all(torch.isfinite(t).all() for s in a["optimizer"]["state"].values() for t in s.values())
        # every snapshot the ring held, after every step: sharded, about half the bytes of the full copy
        assert len(a["ring"]) == len(o["ring"]) == 10
        for held_a, held_o in zip(a["ring"], o["ring"]):
            assert [s for s, _, _ in held_a] == [s for s, _, _ in held_o] and held_a
            assert all(sharded for _, sharded, _ in held_a) and not any(sharded for _, sharded, _ in held_o)
            assert all(na < 0.6 * no for (_, _, na), (_, _, no) in zip(held_a, held_o)), (held_a, held_o)
        assert o["sharded_nbytes"] == 0 and 0 < a["sharded_nbytes"] <= o["snapshot_nbytes"] / 2
        # the candidate of step 8 overwrote the slices of the snapshot of step 2 (the spare once step 6 verified)
        assert a["storage"][8] == a["storage"][2] and a["storage"][4] != a["storage"][2]
        # no host read by the guard on a clean step: only where a bad step's flags were read
        reads = a["reads_per_step"]
        late = {e["details"]["read_at_step"] for e in a["events"] if "read_at_step" in e["details"]}
        assert len(reads) == 10 and {i for i, n in enumerate(reads) if n} == late, (reads, late)
    assert auto[0]["checkpoints"].keys() == off[0]["checkpoints"].keys() and auto[0]["checkpoints"]
    assert _bitwise(auto[0]["checkpoints"], off[0]["checkpoints"])
    # action="halt": every rank stops at the same step with the verified snapshot gathered back, bitwise as "off"
    halt = {(m, r): load(f"halt_{m}", r) for m in ("auto", "off") for r in (0, 1)}
    for r in (0, 1):
        h, o = halt[("auto", r)], halt[("off", r)]
        assert h["sharded"] and not o["sharded"]
        assert h["global_step"] == o["global_step"] == halt[("auto", 0)]["global_step"] < 10
        assert _bitwise(h["state"], o["state"]) and _bitwise(h["optimizer"], o["optimizer"])
        assert h["events"] == o["events"] and h["counters"] == o["counters"]
        assert any(e["action"] == "halt" for e in h["events"])
        assert h["raised"] and h["raised"] == o["raised"].replace("ng_halt_off", "ng_halt_auto")  # both ranks raised
        assert all(torch.isfinite(t).all() for t in h["state"].values() if t.is_floating_point())
    # a NaN weight on rank 1 at the last step (9): step 9 is skipped on the device, and the pending flags, read once
    # at the end of the fit, roll every rank back to the verified snapshot (gathered when sharded), bitwise as "off"
    end = {(m, r): load(f"end_{m}", r) for m in ("auto", "off") for r in (0, 1)}
    assert end[("auto", 1)]["fired"] == 1 and end[("auto", 0)]["fired"] == 0
    for r in (0, 1):
        e, o = end[("auto", r)], end[("off", r)]
        assert e["global_step"] == 10 and e["counters"]["rollbacks"] == 1 and e["counters"] == o["counters"]
        assert e["events"] == o["events"] == end[("auto", 0)]["events"]
        late = [x for x in e["events"] if x["details"].get("read_at_step") == 10]
        assert late and all(x["step"] == 9 and x["action"] == "rollback" for x in late)
        assert any(x["kind"] == "nonfinite_param" and x["rank"] == 1 for x in late), late
        assert _bitwise(e["state"], o["state"]) and _bitwise(e["optimizer"], o["optimizer"])
        assert all(torch.isfinite(t).all() for t in e["state"].values() if t.is_floating_point())
    weights = [{k: v for k, v in end[("auto", r)]["state"].items() if ".running_" not in k} for r in (0, 1)]
    assert _bitwise(*weights)  # the ranks' weights agree again (BatchNorm statistics are each rank's own under DDP)
    weights = [
        {k: v for k, v in halt[("auto", r)]["state"].items() if "running" not in k and "batches" not in k}
        for r in (0, 1)
    ]
    assert _bitwise(weights[0], weights[1])  # the ranks agree on the weights (BatchNorm statistics are per rank)
    assert _bitwise(halt[("auto", 0)]["last_finite"], halt[("auto", 0)]["state"])  # last_finite.ckpt: what was restored
    # the late events are merged across ranks: both ranks record the same ones, each place named
    late_events = [[e for e in auto[r]["events"] if "read_at_step" in e["details"]] for r in (0, 1)]
    assert late_events[0] and late_events[0] == late_events[1]
    assert not any(e["where"][0].startswith("a ") for e in late_events[0]), late_events[0]
    print({f"rank{r}": (auto[r]["snapshot_nbytes"], off[r]["snapshot_nbytes"]) for r in (0, 1)})


@pytest.fixture(scope="module")
def spike_launch(pack: Pack) -> Path:
    """The ``spike`` site's four fits: a spike action, then a check of one's own, in both sync modes."""
    return pack("spike")


@pytest.mark.ddp
def test_a_spike_on_one_rank_is_skipped_by_every_rank_with_the_same_window(spike_launch):
    """An outlier batch on rank 1 only (finite, its loss ~1000x) at step 20: the loss rides the one MAX all-reduce, so
    both ranks judge the same value against the same window, skip the same step (in both sync modes) and end with
    identical windows and weights."""
    import torch

    for mode in ("every_step", "deferred"):
        ranks = [torch.load(spike_launch / f"spike_{mode}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        for r in ranks:
            spikes = [(e["kind"], e["step"], e["action"]) for e in r["events"] if e["kind"] == "loss_spike"]
            assert spikes == [("loss_spike", 20, "skip")], (mode, r["events"])
            assert r["counters"]["spikes"] == 1 and r["counters"]["skipped_steps"] == 1
            assert torch.equal(r["params"][0], r["params"][1]) and torch.isfinite(r["params"]).all()
        assert ranks[0]["window"] == ranks[1]["window"], mode
        assert ranks[0]["events"] == ranks[1]["events"], mode


@pytest.mark.ddp
def test_a_check_of_ones_own_rides_the_one_all_reduce_and_every_rank_acts_on_it(spike_launch):
    """The same outlier seen by ``extra_checks=[LossAbove(100)]`` (no spike action) in the same launch: its flag rides
    the step's one all-reduce, which keeps the rank that saw it (1), and both ranks skip the same step."""
    import torch

    for mode in ("every_step", "deferred"):
        ranks = [torch.load(spike_launch / f"spike_extra_{mode}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        for r in ranks:
            seen = [(e["kind"], e["step"], e["rank"]) for e in r["events"]]
            assert seen == [("loss_above", 20, 1)], (mode, r["events"])
            assert r["events"][0]["action"] == ("rollback" if mode == "every_step" else "skip"), r["events"]
            assert r["counters"]["incidents"] == 1 and r["counters"]["skipped_steps"] == 1
            assert torch.equal(r["params"][0], r["params"][1]) and torch.isfinite(r["params"]).all()
        assert ranks[0]["events"] == ranks[1]["events"], mode
