"""Tests of ``lightning_numguard.detect.opguard.mode``: records, flags, module attribution, ``describe``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_numguard.detect.opguard import OpGuard, OpRecord, describe
from tests.detect.test_opguard import BAD_INDEX, CPU, GOOD_INDEX, _source, _weight


def test_enabled_can_be_toggled_inside_the_context() -> None:
    guard = OpGuard()
    with guard:
        guard.enabled = False
        with pytest.raises(IndexError, match="index out of range in self"):
            F.embedding(torch.tensor([5]), _weight())
        guard.enabled = True
        F.embedding(torch.tensor([5]), _weight())
    assert [record.op for record in guard.records] == ["embedding"]


def test_records_hold_module_order_and_the_unsanitised_tensor() -> None:
    guard = OpGuard()
    bad_index = torch.tensor([[7]])
    with guard:
        guard.module_resolver = lambda: "encoder.embed"
        F.embedding(torch.tensor([1]), _weight())
        guard.module_resolver = lambda: "encoder.pick"
        torch.gather(_source(), 1, bad_index)
        guard.module_resolver = None
        F.one_hot(torch.tensor([1]), 2)
    assert [(r.op, r.module) for r in guard.records] == [
        ("embedding", "encoder.embed"),
        ("gather", "encoder.pick"),
        ("one_hot", None),
    ]
    assert torch.equal(guard.flags(CPU), torch.tensor([0.0, 1.0, 0.0]))
    gather = guard.records[1]
    assert gather.checked.data_ptr() == bad_index.data_ptr()  # a reference, not a copy
    assert torch.equal(gather.checked, bad_index)  # as given, not as sanitised
    assert gather.rule == "index in [0, 3) along dim 1"
    assert (gather.low, gather.high) == (0.0, 3.0)
    assert OpGuard.describe(gather)["module"] == "encoder.pick"


def test_reset_starts_a_new_list_and_empty_flags() -> None:
    guard = OpGuard()
    with guard:
        F.one_hot(torch.tensor([4]), 2)
    old = guard.records
    guard.reset()
    assert guard.records == []
    assert len(old) == 1
    flags = guard.flags(CPU)
    assert flags.shape == (0,)
    assert flags.dtype == torch.float32


def test_flags_live_on_the_ops_device() -> None:
    meta = torch.device("meta")
    guard = OpGuard()
    with guard:
        F.cross_entropy(torch.zeros(2, 10, device=meta), torch.tensor([1, 10], device=meta))
        torch.gather(torch.zeros(2, 3, device=meta), 1, GOOD_INDEX.to(meta))
        torch.multinomial(torch.ones(2, 3, dtype=torch.float16, device=meta), 1)
    assert [r.flag.device for r in guard.records] == [meta] * 3
    flags = guard.flags(meta)
    assert (flags.device, flags.shape, flags.dtype) == (meta, (3,), torch.float32)


def test_unguarded_ops_pass_through_without_records() -> None:
    guard = OpGuard()
    x = torch.randn(3, 3)
    with guard:
        y = torch.add(x, 1).relu().sum(0)
    assert torch.equal(y, torch.add(x, 1).relu().sum(0))
    assert guard.records == []


def test_a_single_op_name_is_accepted() -> None:
    guard = OpGuard(ops="gather")
    with guard:
        torch.gather(_source(), 1, BAD_INDEX)
        with pytest.raises(IndexError, match="index out of range in self"):
            F.embedding(torch.tensor([5]), _weight())
    assert [r.op for r in guard.records] == ["gather"]


def test_unknown_op_name_is_rejected() -> None:
    expected = r"unknown op name\(s\) \['softmax'\]; allowed: \['binary_cross_entropy', 'cross_entropy'"
    with pytest.raises(ValueError, match=expected):
        OpGuard(ops=["gather", "softmax"])


def test_large_integer_indices_are_judged_exactly() -> None:
    size = 2**24 + 2
    source = torch.zeros(size, dtype=torch.uint8)
    guard = OpGuard()
    with guard:
        torch.index_select(source, 0, torch.tensor([size - 1, size]))
    info = OpGuard.describe(guard.records[0])
    assert (info["count"], info["first_indices"], info["max"]) == (1, [[1]], float(size))


def test_describe_on_a_clean_record() -> None:
    record = OpRecord(
        op="gather",
        module=None,
        flag=torch.tensor(False),
        checked=torch.tensor([0, 1]),
        rule="index in [0, 2) along dim 0",
        low=0.0,
        high=2.0,
    )
    info = OpGuard.describe(record)
    assert (info["count"], info["min"], info["max"], info["first_indices"]) == (0, None, None, [])


def test_module_resolver_is_called_at_guarded_calls_only() -> None:
    calls: list[str] = []

    def resolver() -> str:
        calls.append("called")
        return f"block{len(calls)}"

    guard = OpGuard()
    guard.module_resolver = resolver
    with guard:
        x = torch.randn(2, 3).relu().sum(0)  # unguarded ops: no call
        assert calls == []
        torch.gather(_source(), 1, GOOD_INDEX)
        F.binary_cross_entropy(torch.tensor([0.5]), torch.tensor([1.0]))  # two records, two calls
        x.add_(1)
    assert calls == ["called"] * 3
    assert [r.module for r in guard.records] == ["block1", "block2", "block3"]


def test_describe_is_one_function_also_reachable_from_the_class() -> None:
    guard = OpGuard()
    with guard:
        torch.gather(_source(), 1, BAD_INDEX)
    info = describe(guard.records[0])
    assert info == OpGuard.describe(guard.records[0])
    assert set(info) == {"op", "module", "rule", "count", "nan_count", "min", "max", "first_indices"}
