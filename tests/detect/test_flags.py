"""The packed flag vector: slots, packing, and the rank each slot carries through a MAX reduce."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from lightning_numguard.detect import flags

NAN, INF = float("nan"), float("inf")
ZERO = torch.zeros(())


def packed(**values: float) -> torch.Tensor:
    args = dict.fromkeys(
        ("input_max", "norm_total", "output_total", "loss_total", "suspicious", "op", "quarantine"), 0.0
    )
    args.update(values)
    return flags.pack(**{k: torch.tensor(v) for k, v in args.items()})


def test_slots_are_in_causal_order_and_numbered():
    assert flags.SLOTS == ("input", "norms", "output", "loss", "suspicious", "op", "quarantine")
    assert list(range(7)) == [
        flags.INPUT,
        flags.NORMS,
        flags.OUTPUT,
        flags.LOSS,
        flags.SUSPICIOUS,
        flags.OP,
        flags.QUARANTINE,
    ]


# what went into the pack -> which slots are seen
PACKS = [
    ({}, set()),
    ({"input_max": NAN}, {flags.INPUT}),
    ({"input_max": 1e30}, set()),  # a huge finite max is not non-finite (the suspicious flag says "huge")
    ({"norm_total": INF}, {flags.NORMS}),
    ({"output_total": -INF}, {flags.OUTPUT}),
    ({"loss_total": NAN, "op": 1.0}, {flags.LOSS, flags.OP}),
    ({"suspicious": 1.0}, {flags.SUSPICIOUS}),
    ({"quarantine": 1.0}, {flags.QUARANTINE}),
]


@pytest.mark.parametrize(("values", "seen"), PACKS)
def test_pack_marks_non_finite_totals_and_raised_flags(values, seen):
    decoded = flags.decode(packed(**values).tolist(), world=1)
    assert {s for s in range(len(flags.SLOTS)) if decoded.seen(s)} == seen
    assert decoded.any is bool(seen)
    assert all(decoded.rank(s) == 0 for s in seen)


@pytest.mark.parametrize(("values", "seen"), PACKS)
def test_one_process_reads_the_raw_values_and_decodes_them_like_a_pack(values, seen):
    args = dict.fromkeys(("input_max", "norm_total", "output_total", "loss_total"), 0.0)
    args.update(dict.fromkeys(("suspicious", "op", "quarantine"), 0.0))
    args.update(values)
    raw = [torch.tensor(v, dtype=torch.float64 if k == "loss_total" else torch.float32) for k, v in args.items()]
    vector = flags.stack_raw(raw)
    assert vector.dtype == torch.float32 and vector.shape == (len(flags.SLOTS),)
    decoded = flags.decode_raw(vector.tolist())
    assert decoded == flags.decode(packed(**values).tolist(), world=1)
    assert {s for s in range(len(flags.SLOTS)) if decoded.seen(s)} == seen


def test_decode_raw_wants_every_slot():
    with pytest.raises(ValueError, match="expected 7 slot values"):
        flags.decode_raw([0.0] * 6)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_a_max_reduce_keeps_the_lowest_rank_that_saw_each_slot(world):
    # rank r sees the input slot when r is odd, the loss slot only on the last rank
    per_rank = [
        flags.encode_rank(packed(input_max=NAN if r % 2 else 0.0, loss_total=NAN if r == world - 1 else 0.0), r, world)
        for r in range(world)
    ]
    reduced = torch.stack(per_rank).amax(0)
    decoded = flags.decode(reduced.tolist(), world)
    assert decoded.rank(flags.INPUT) == 1
    assert decoded.rank(flags.LOSS) == world - 1
    assert not decoded.seen(flags.NORMS)
    assert decoded.any_local()


def test_seen_on_tells_each_rank_whether_to_look():
    decoded = flags.decode([2.0, 0, 0, 0, 0, 0, 0], world=3)  # rank 1 saw the input slot
    assert decoded.rank(flags.INPUT) == 1
    assert decoded.seen_on(flags.INPUT, rank=1, world=3)
    assert decoded.seen_on(flags.INPUT, rank=0, world=3)  # with several ranks every rank looks
    assert not decoded.seen_on(flags.LOSS, rank=1, world=3)
    single = flags.decode([1.0, 0, 0, 0, 0, 0, 0], world=1)
    assert single.seen_on(flags.INPUT, rank=0, world=1)


def test_norms_alone_are_not_a_local_incident():
    decoded = flags.decode([0, 1.0, 0, 0, 0, 0, 0], world=1)
    assert decoded.any and not decoded.any_local()


def test_decode_refuses_a_vector_of_the_wrong_length():
    with pytest.raises(ValueError, match="expected 7 flag values"):
        flags.decode([0.0] * 6, world=1)


def test_pack_never_syncs_and_stays_on_the_device():
    out = packed(input_max=NAN)
    assert out.dtype == torch.float32 and out.shape == (7,)
    assert math.isclose(float(out[flags.INPUT]), 1.0)


@pytest.mark.parametrize(
    ("largest", "seen"), [(0.0, False), (1e17, False), (1e18, True), (float("inf"), True), (float("nan"), False)]
)
def test_one_process_compares_the_largest_input_with_the_threshold_on_the_host(largest, seen):
    values = [0.0] * len(flags.SLOTS)
    values[flags.SUSPICIOUS] = largest
    assert flags.decode_raw(values, suspicious_at=1e18).seen(flags.SUSPICIOUS) is seen
    zero = {name: torch.zeros(()) for name in inspect.signature(flags.pack).parameters}
    device = flags.pack(**{**zero, "suspicious": torch.tensor(largest) >= 1e18})  # what a pack carries instead
    assert flags.decode(device.tolist(), world=1).seen(flags.SUSPICIOUS) is seen


def test_a_bool_flag_is_stacked_as_one_and_zero():
    raw = [torch.tensor(0.0)] * 4 + [torch.tensor(True), torch.tensor(False), torch.tensor(0.0)]
    vector = flags.stack_raw(raw)
    assert vector.dtype == torch.float32 and vector.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_one_stack_of_mixed_dtypes_casts_to_float32_as_each_value_would():
    raw = [
        torch.tensor(1.5),
        torch.tensor(3.0, dtype=torch.float16),
        torch.tensor(1e300, dtype=torch.float64),  # beyond float32: inf, as its own cast gives
        torch.tensor(1.0 + 2**-40, dtype=torch.float64),  # rounded once
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.tensor(True),
        torch.tensor(7),
    ]
    vector = flags.stack_raw(raw[:4], raw[4:])
    assert vector.dtype == torch.float32
    assert torch.equal(vector, torch.stack([v.float() for v in raw]))


@pytest.mark.parametrize("suspicious_at", [None, 1.0])
def test_decode_raw_sees_non_finite_totals_and_positive_flags_only(suspicious_at):
    values = [1.0, NAN, -INF, 5.0, 2.0, 0.0, 1.0]
    seen = {flags.NORMS, flags.OUTPUT, flags.SUSPICIOUS, flags.QUARANTINE}
    decoded = flags.decode_raw(values, suspicious_at)
    assert {s for s in range(len(flags.SLOTS)) if decoded.seen(s)} == seen
    values[flags.SUSPICIOUS] = NAN if suspicious_at is not None else -1.0  # NaN is never at least the threshold
    assert not flags.decode_raw(values, suspicious_at).seen(flags.SUSPICIOUS)


@pytest.mark.parametrize("suspicious_at", [None, 1.0])
@pytest.mark.parametrize("slot", range(len(flags.SLOTS)))
def test_decode_raw_of_a_clean_step_is_clean_and_one_bad_slot_is_seen_alone(slot, suspicious_at):
    clean = [3.0, 1e38, 0.0, 2.0, 0.5 if suspicious_at is not None else 0.0, 0.0, 0.0]
    assert flags.decode_raw(clean, suspicious_at) == flags.CLEAN and not flags.CLEAN.any
    values = list(clean)
    values[slot] = NAN if slot <= flags.LOSS else 1.0  # a total not finite, a flag set (or the largest input at 1.0)
    decoded = flags.decode_raw(values, suspicious_at)
    assert [s for s in range(len(flags.SLOTS)) if decoded.seen(s)] == [slot] and decoded.any
