"""Tests of ``lightning_numguard.core.opguard``: every guarded op, valid and invalid, on CPU."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_numguard.core.opguard import GUARDED_OPS, HINTS, OpGuard, OpRecord

NAN = float("nan")
INF = float("inf")
CPU = torch.device("cpu")


def _logits(rows: int = 3, classes: int = 10) -> torch.Tensor:
    return torch.linspace(-2.0, 2.0, rows * classes).reshape(rows, classes)


def _weight(rows: int = 5, dim: int = 2) -> torch.Tensor:
    return torch.arange(rows * dim, dtype=torch.float32).reshape(rows, dim)


def _source() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3)


def _seeded(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        torch.manual_seed(0)
        return fn()

    return call


@dataclass
class Case:
    """A valid and an invalid call of one op form, and what ``describe`` must say about the invalid one."""

    id: str
    op: str
    valid: Callable[[], Any]
    invalid: Callable[[], Any]
    error: type[Exception]
    match: str
    count: int
    min: float | None
    max: float | None
    first_indices: list[list[int]]
    nan_count: int = 0
    records: int = 1  # records one call leaves
    flagged: int = 0  # which of them is the violation


BCE_GOOD = torch.tensor([0.0, 0.3, 1.0, 0.7])
BCE_BAD = torch.tensor([0.2, NAN, 2.0, -0.5, INF])
BCE_TARGET = torch.tensor([0.0, 1.0, 1.0, 0.0])
BCE_TARGET5 = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
TWO_BAD = [[0, 1], [1, 0]]
BAD_INDEX = torch.tensor([[0, 3], [-1, 2]])
GOOD_INDEX = torch.tensor([[0, 2], [1, 1]])

CASES = [
    Case(
        "F.binary_cross_entropy",
        "binary_cross_entropy",
        lambda: F.binary_cross_entropy(BCE_GOOD, BCE_TARGET),
        lambda: F.binary_cross_entropy(BCE_BAD, BCE_TARGET5),
        RuntimeError,
        "all elements of input should be between 0 and 1",
        count=4,
        min=-0.5,
        max=INF,
        first_indices=[[1], [2], [3], [4]],
        nan_count=1,
        records=2,
    ),
    Case(
        "nn.BCELoss",
        "binary_cross_entropy",
        lambda: torch.nn.BCELoss(reduction="none")(BCE_GOOD, BCE_TARGET),
        lambda: torch.nn.BCELoss(reduction="none")(torch.tensor([[0.5, 1.5]]), torch.tensor([[0.0, 1.0]])),
        RuntimeError,
        "all elements of input should be between 0 and 1",
        count=1,
        min=1.5,
        max=1.5,
        first_indices=[[0, 1]],
        records=2,
    ),
    Case(
        "F.binary_cross_entropy target",
        "binary_cross_entropy",
        lambda: F.binary_cross_entropy(BCE_GOOD, BCE_TARGET, reduction="sum"),
        lambda: F.binary_cross_entropy(BCE_GOOD, torch.tensor([0.0, 1.0, 1.5, NAN]), reduction="sum"),
        RuntimeError,
        "all elements of target should be between 0 and 1",
        count=2,
        min=1.5,
        max=1.5,
        first_indices=[[2], [3]],
        nan_count=1,
        records=2,
        flagged=1,
    ),
    Case(
        "torch._C._nn.binary_cross_entropy",
        "binary_cross_entropy",
        lambda: torch._C._nn.binary_cross_entropy(BCE_GOOD, BCE_TARGET),
        lambda: torch._C._nn.binary_cross_entropy(BCE_BAD, BCE_TARGET5),
        RuntimeError,
        "all elements of input should be between 0 and 1",
        count=4,
        min=-0.5,
        max=INF,
        first_indices=[[1], [2], [3], [4]],
        nan_count=1,
        records=2,
    ),
    Case(
        "F.nll_loss",
        "nll_loss",
        lambda: F.nll_loss(_logits().log_softmax(1), torch.tensor([1, 9, -100])),
        lambda: F.nll_loss(_logits().log_softmax(1), torch.tensor([1, 10, -100])),
        IndexError,
        "Target 10 is out of bounds",
        count=1,
        min=10,
        max=10,
        first_indices=[[1]],
    ),
    Case(
        "F.nll_loss ignore_index keyword",
        "nll_loss",
        lambda: F.nll_loss(_logits().log_softmax(1), torch.tensor([-1, 0, 2]), ignore_index=-1),
        lambda: F.nll_loss(_logits().log_softmax(1), torch.tensor([-1, -100, 2]), ignore_index=-1),
        IndexError,
        "Target -100 is out of bounds",
        count=1,
        min=-100,
        max=-100,
        first_indices=[[1]],
    ),
    Case(
        "F.nll_loss 1-D input",
        "nll_loss",
        lambda: F.nll_loss(torch.linspace(-3, -1, 10), torch.tensor(9)),
        lambda: F.nll_loss(torch.linspace(-3, -1, 10), torch.tensor(10)),
        IndexError,
        "Target 10 is out of bounds",
        count=1,
        min=10,
        max=10,
        first_indices=[[]],
    ),
    Case(
        "torch._C._nn.nll_loss positional ignore_index",
        "nll_loss",
        lambda: torch._C._nn.nll_loss(_logits().log_softmax(1), torch.tensor([-7, 0, 2]), None, 1, -7),
        lambda: torch._C._nn.nll_loss(_logits().log_softmax(1), torch.tensor([-7, 12, -100]), None, 1, -7),
        IndexError,
        "Target 12 is out of bounds",
        count=2,
        min=-100,
        max=12,
        first_indices=[[1], [2]],
    ),
    Case(
        "F.cross_entropy",
        "cross_entropy",
        lambda: F.cross_entropy(_logits(), torch.tensor([3, 0, 9])),
        lambda: F.cross_entropy(_logits(), torch.tensor([3, 10, 11])),
        IndexError,
        "Target 10 is out of bounds",
        count=2,
        min=10,
        max=11,
        first_indices=[[1], [2]],
    ),
    Case(
        "nn.CrossEntropyLoss K-dim",
        "cross_entropy",
        lambda: torch.nn.CrossEntropyLoss()(_logits(2, 15).reshape(2, 5, 3), torch.tensor([[0, 4, 1], [2, 3, 4]])),
        lambda: torch.nn.CrossEntropyLoss()(_logits(2, 15).reshape(2, 5, 3), torch.tensor([[0, 4, 1], [2, 3, -1]])),
        IndexError,
        "Target -1 is out of bounds",
        count=1,
        min=-1,
        max=-1,
        first_indices=[[1, 2]],
    ),
    Case(
        "torch._C._nn.cross_entropy_loss",
        "cross_entropy",
        lambda: torch._C._nn.cross_entropy_loss(_logits(), torch.tensor([3, 0, 9])),
        lambda: torch._C._nn.cross_entropy_loss(_logits(), torch.tensor([3, 0, 10])),
        IndexError,
        "Target 10 is out of bounds",
        count=1,
        min=10,
        max=10,
        first_indices=[[2]],
    ),
    Case(
        "F.embedding",
        "embedding",
        lambda: F.embedding(torch.tensor([[1, 4], [0, 0]]), _weight()),
        lambda: F.embedding(torch.tensor([[1, 5], [-1, 0]]), _weight()),
        IndexError,
        "index out of range in self",
        count=2,
        min=-1,
        max=5,
        first_indices=TWO_BAD,
    ),
    Case(
        "nn.Embedding",
        "embedding",
        lambda: _seeded(lambda: torch.nn.Embedding(5, 2)(torch.tensor([4, 0])))(),
        lambda: _seeded(lambda: torch.nn.Embedding(5, 2)(torch.tensor([40, 0])))(),
        IndexError,
        "index out of range in self",
        count=1,
        min=40,
        max=40,
        first_indices=[[0]],
    ),
    Case(
        "torch.embedding",
        "embedding",
        lambda: torch.embedding(_weight(), torch.tensor([1, 4])),
        lambda: torch.embedding(_weight(), torch.tensor([1, 6])),
        IndexError,
        "index out of range in self",
        count=1,
        min=6,
        max=6,
        first_indices=[[1]],
    ),
    Case(
        "F.embedding_bag",
        "embedding_bag",
        lambda: F.embedding_bag(torch.tensor([[0, 4], [1, 2]]), _weight()),
        lambda: F.embedding_bag(torch.tensor([[0, 7], [-3, 2]]), _weight()),
        RuntimeError,
        "not in the valid range|Expected i < index_size",
        count=2,
        min=-3,
        max=7,
        first_indices=TWO_BAD,
    ),
    Case(
        "nn.EmbeddingBag offsets",
        "embedding_bag",
        lambda: _seeded(lambda: torch.nn.EmbeddingBag(5, 2)(torch.tensor([0, 4, 1]), torch.tensor([0, 2])))(),
        lambda: _seeded(lambda: torch.nn.EmbeddingBag(5, 2)(torch.tensor([0, 5, 1]), torch.tensor([0, 2])))(),
        RuntimeError,
        "not in the valid range",
        count=1,
        min=5,
        max=5,
        first_indices=[[1]],
    ),
    Case(
        "torch.embedding_bag",
        "embedding_bag",
        lambda: torch.embedding_bag(_weight(), torch.tensor([0, 4, 1]), torch.tensor([0, 2]))[0],
        lambda: torch.embedding_bag(_weight(), torch.tensor([0, 9, 1]), torch.tensor([0, 2]))[0],
        RuntimeError,
        "not in the valid range",
        count=1,
        min=9,
        max=9,
        first_indices=[[1]],
    ),
    Case(
        "torch.gather",
        "gather",
        lambda: torch.gather(_source(), 1, GOOD_INDEX),
        lambda: torch.gather(_source(), 1, BAD_INDEX),
        RuntimeError,
        "index 3 is out of bounds for dimension 1 with size 3",
        count=2,
        min=-1,
        max=3,
        first_indices=TWO_BAD,
    ),
    Case(
        "Tensor.gather keywords",
        "gather",
        lambda: _source().gather(dim=-1, index=GOOD_INDEX),
        lambda: _source().gather(dim=-1, index=BAD_INDEX),
        RuntimeError,
        "index 3 is out of bounds for dimension 1 with size 3",
        count=2,
        min=-1,
        max=3,
        first_indices=TWO_BAD,
    ),
    Case(
        "torch.scatter value",
        "scatter",
        lambda: torch.scatter(_source(), 1, GOOD_INDEX, 9.0),
        lambda: torch.scatter(_source(), 1, BAD_INDEX, 9.0),
        RuntimeError,
        "index 3 is out of bounds for dimension 1 with size 3",
        count=2,
        min=-1,
        max=3,
        first_indices=TWO_BAD,
    ),
    Case(
        "Tensor.scatter src",
        "scatter",
        lambda: _source().scatter(0, torch.tensor([[1, 0, 1]]), -_source()),
        lambda: _source().scatter(0, torch.tensor([[1, 2, 1]]), -_source()),
        RuntimeError,
        "index 2 is out of bounds for dimension 0 with size 2",
        count=1,
        min=2,
        max=2,
        first_indices=[[0, 1]],
    ),
    Case(
        "Tensor.scatter_",
        "scatter",
        lambda: _source().scatter_(1, GOOD_INDEX, -_source()),
        lambda: _source().scatter_(1, BAD_INDEX, -_source()),
        RuntimeError,
        "index 3 is out of bounds for dimension 1 with size 3",
        count=2,
        min=-1,
        max=3,
        first_indices=TWO_BAD,
    ),
    Case(
        "torch.scatter_add",
        "scatter_add",
        lambda: torch.scatter_add(_source(), 1, GOOD_INDEX, _source()),
        lambda: torch.scatter_add(_source(), 1, BAD_INDEX, _source()),
        RuntimeError,
        "index 3 is out of bounds for dimension 1 with size 3",
        count=2,
        min=-1,
        max=3,
        first_indices=TWO_BAD,
    ),
    Case(
        "Tensor.scatter_add",
        "scatter_add",
        lambda: _source().scatter_add(1, GOOD_INDEX, _source()),
        lambda: _source().scatter_add(1, BAD_INDEX, _source()),
        RuntimeError,
        "index 3 is out of bounds for dimension 1 with size 3",
        count=2,
        min=-1,
        max=3,
        first_indices=TWO_BAD,
    ),
    Case(
        "Tensor.scatter_add_",
        "scatter_add",
        lambda: _source().scatter_add_(1, GOOD_INDEX, _source()),
        lambda: _source().scatter_add_(1, BAD_INDEX, _source()),
        RuntimeError,
        "index 3 is out of bounds for dimension 1 with size 3",
        count=2,
        min=-1,
        max=3,
        first_indices=TWO_BAD,
    ),
    Case(
        "torch.index_select",
        "index_select",
        lambda: torch.index_select(_source(), 1, torch.tensor([2, 0, 2])),
        lambda: torch.index_select(_source(), 1, torch.tensor([2, 3, -1])),
        RuntimeError,
        "INDICES element is out of DATA bounds",
        count=2,
        min=-1,
        max=3,
        first_indices=[[1], [2]],
    ),
    Case(
        "Tensor.index_select",
        "index_select",
        lambda: _source().index_select(0, torch.tensor([1, 0])),
        lambda: _source().index_select(0, torch.tensor([1, 2])),
        IndexError,  # along dim 0 the CPU kernel raises IndexError, along dim 1 RuntimeError
        "index out of range in self",
        count=1,
        min=2,
        max=2,
        first_indices=[[1]],
    ),
    Case(
        "F.one_hot",
        "one_hot",
        lambda: F.one_hot(torch.tensor([0, 2, 1]), 3),
        lambda: F.one_hot(torch.tensor([0, 3, -1]), 3),
        RuntimeError,
        "Class values must be",
        count=2,
        min=-1,
        max=3,
        first_indices=[[1], [2]],
    ),
    Case(
        "F.one_hot inferred",
        "one_hot",
        lambda: F.one_hot(torch.tensor([0, 5, 1])),
        lambda: F.one_hot(torch.tensor([[0, 5], [-2, 1]])),
        RuntimeError,
        "Class values must be non-negative",
        count=1,
        min=-2,
        max=-2,
        first_indices=[[1, 0]],
    ),
    Case(
        "torch.multinomial",
        "multinomial",
        _seeded(lambda: torch.multinomial(torch.tensor([[0.2, 0.8], [0.0, 1.0]]), 1)),
        _seeded(lambda: torch.multinomial(torch.tensor([[0.2, 0.8], [0.0, 0.0], [NAN, 1.0]]), 1)),
        RuntimeError,
        "invalid multinomial distribution|probability tensor contains",
        count=3,
        min=0.0,
        max=0.0,
        first_indices=[[1, 0], [1, 1], [2, 0]],
        nan_count=1,
    ),
    Case(
        "Tensor.multinomial replacement",
        "multinomial",
        _seeded(lambda: torch.tensor([0.1, 0.0, 0.9]).multinomial(5, replacement=True)),
        _seeded(lambda: torch.tensor([0.1, -0.5, 0.9, INF]).multinomial(5, replacement=True)),
        RuntimeError,
        "invalid multinomial distribution|probability tensor contains",
        count=2,
        min=-0.5,
        max=INF,
        first_indices=[[1], [3]],
    ),
]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return all(_same(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def no_sync() -> Iterator[None]:
    """Count every Python-level way of reading a tensor on the host during the test; none may happen."""
    from lightning_numguard.core.syncs import SyncCounter

    with SyncCounter(copies_from_cpu=True) as counter:
        with counter.step():
            bool(torch.tensor(True))
        assert counter.step_total == [1]  # the counter is live
        with counter.step():
            yield
    assert counter.step_total == [1, 0], f"host sync on the hot path: {dict(counter.sites)}"


def test_cases_cover_every_guarded_op() -> None:
    assert {case.op for case in CASES} == GUARDED_OPS
    assert set(HINTS) == GUARDED_OPS
    assert all(HINTS.values())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_valid_call_is_unchanged_and_not_flagged(case: Case) -> None:
    expected = case.valid()
    guard = OpGuard()
    with guard:
        got = case.valid()
    assert _same(got, expected)
    assert len(guard.records) == case.records
    assert all(record.op == case.op for record in guard.records)
    assert torch.equal(guard.flags(CPU), torch.zeros(case.records))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_call_raises_without_the_guard(case: Case) -> None:
    with pytest.raises(case.error, match=case.match):
        case.invalid()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_call_is_flagged_and_defused(case: Case) -> None:
    guard = OpGuard()
    with guard:
        result = case.invalid()
    assert result is not None
    expected_flags = torch.zeros(case.records)
    expected_flags[case.flagged] = 1.0
    assert torch.equal(guard.flags(CPU), expected_flags)
    record = guard.records[case.flagged]
    assert record.op == case.op
    assert record.flag.dtype == torch.bool
    assert record.flag.shape == ()
    info = OpGuard.describe(record)
    assert info["op"] == case.op
    assert info["count"] == case.count
    assert info["nan_count"] == case.nan_count
    assert info["min"] == case.min
    assert info["max"] == case.max
    assert info["first_indices"] == case.first_indices
    assert info["hint"] == HINTS[case.op]
    assert info["rule"] == record.rule


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_sanitize_false_flags_then_the_op_raises(case: Case) -> None:
    guard = OpGuard(sanitize=False)
    with guard, pytest.raises(case.error, match=case.match):
        case.invalid()
    assert guard.records[case.flagged].flag.item() is True


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_disabled_guard_passes_calls_through(case: Case) -> None:
    guard = OpGuard()
    guard.enabled = False
    with guard, pytest.raises(case.error, match=case.match):
        case.invalid()
    assert guard.records == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_guard_limited_to_other_ops_ignores_this_one(case: Case) -> None:
    others = GUARDED_OPS - {case.op}
    guard = OpGuard(ops=others)
    with guard, pytest.raises(case.error, match=case.match):
        case.invalid()
    assert guard.records == []


@pytest.mark.usefixtures("no_sync")
def test_guarded_calls_never_read_a_tensor_on_the_host() -> None:
    guard = OpGuard()
    guard.current_module = "model.head"
    with guard:
        for case in CASES:
            case.valid()
            case.invalid()
    flags = guard.flags(CPU)
    assert flags.shape == (sum(2 * case.records for case in CASES),)


def test_enabled_can_be_toggled_inside_the_context() -> None:
    guard = OpGuard()
    with guard:
        guard.enabled = False
        with pytest.raises(IndexError, match="index out of range in self"):
            F.embedding(torch.tensor([5]), _weight())
        guard.enabled = True
        F.embedding(torch.tensor([5]), _weight())
    assert [record.op for record in guard.records] == ["embedding"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_binary_cross_entropy_dtypes(dtype: torch.dtype) -> None:
    probs = torch.tensor([0.25, 1.5, NAN, 0.75, -INF], dtype=dtype)
    target = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0], dtype=dtype)
    guard = OpGuard()
    with guard:
        loss = F.binary_cross_entropy(probs, target, reduction="none")
    assert loss.dtype == dtype
    assert torch.isfinite(loss).all()
    valid = torch.tensor([0, 3])
    reference = F.binary_cross_entropy(probs[valid], target[valid], reduction="none")
    torch.testing.assert_close(loss[valid], reference)
    torch.testing.assert_close(loss[1], F.binary_cross_entropy(torch.tensor(0.5, dtype=dtype), target[1]))
    input_record, target_record = guard.records
    assert input_record.flag.item() is True
    assert target_record.flag.item() is False
    assert input_record.checked.dtype == dtype
    info = OpGuard.describe(input_record)
    assert (info["count"], info["nan_count"], info["min"], info["max"]) == (3, 1, -INF, 1.5)
    assert info["first_indices"] == [[1], [2], [4]]


def test_gradients_flow_to_valid_binary_cross_entropy_inputs() -> None:
    probs = torch.tensor([0.3, 2.0, 0.6, NAN], requires_grad=True)
    target = torch.tensor([1.0, 0.0, 0.0, 1.0])
    with OpGuard():
        F.binary_cross_entropy(probs, target, reduction="sum").backward()
    assert probs.grad is not None
    valid = probs.detach()[[0, 2]].requires_grad_()
    F.binary_cross_entropy(valid, target[[0, 2]], reduction="sum").backward()
    assert valid.grad is not None
    torch.testing.assert_close(probs.grad[[0, 2]], valid.grad)
    assert torch.equal(probs.grad[[1, 3]], torch.zeros(2))


def test_records_hold_module_order_and_the_unsanitised_tensor() -> None:
    guard = OpGuard()
    bad_index = torch.tensor([[7]])
    with guard:
        guard.current_module = "encoder.embed"
        F.embedding(torch.tensor([1]), _weight())
        guard.current_module = "encoder.pick"
        torch.gather(_source(), 1, bad_index)
        guard.current_module = None
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


def test_rule_texts() -> None:
    guard = OpGuard()
    with guard:
        F.binary_cross_entropy(BCE_GOOD, BCE_TARGET)
        F.cross_entropy(torch.zeros(2, 10), torch.tensor([1, 2]))
        F.nll_loss(torch.zeros(2, 4), torch.tensor([1, 2]), ignore_index=3)
        F.embedding(torch.tensor([1]), _weight())
        F.one_hot(torch.tensor([1]))
        torch.multinomial(torch.ones(3), 1)
    assert [(r.rule, r.low, r.high, r.ignore_index) for r in guard.records] == [
        ("input in [0, 1]", 0.0, 1.0, None),
        ("target in [0, 1]", 0.0, 1.0, None),
        ("target in [0, 10) or == ignore_index (-100)", 0.0, 10.0, -100),
        ("target in [0, 4) or == ignore_index (3)", 0.0, 4.0, 3),
        ("index in [0, 5)", 0.0, 5.0, None),
        ("value >= 0 (num_classes inferred)", 0.0, None, None),
        ("probabilities finite and >= 0, each row sum > 0", 0.0, None, None),
    ]


def test_cross_entropy_is_recorded_once_and_probability_targets_are_skipped() -> None:
    guard = OpGuard()
    probs = torch.full((2, 10), 0.1)
    with guard:
        loss = F.cross_entropy(_logits(2), probs)
        F.cross_entropy(_logits(2), torch.tensor([1, 2]))
    torch.testing.assert_close(loss, F.cross_entropy(_logits(2), probs))
    assert [r.op for r in guard.records] == ["cross_entropy"]


def test_cross_entropy_with_every_target_bad_gives_nan_loss() -> None:
    guard = OpGuard()
    with guard:
        loss = F.cross_entropy(_logits(2), torch.tensor([10, -5]))
    assert math.isnan(loss.item())
    assert guard.records[0].flag.item() is True


def test_class_targets_are_replaced_by_ignore_index() -> None:
    logits = _logits(3)
    with OpGuard():
        loss = F.cross_entropy(logits, torch.tensor([2, 10, 4]), reduction="none", ignore_index=-1)
    assert loss[1].item() == 0.0
    reference = F.cross_entropy(logits[[0, 2]], torch.tensor([2, 4]), reduction="none")
    torch.testing.assert_close(loss[[0, 2]], reference)


@pytest.mark.parametrize(("padding_idx", "row"), [(None, 0), (3, 3), (-1, 4)])
def test_bad_embedding_index_becomes_padding_idx(padding_idx: int | None, row: int) -> None:
    weight = _weight()
    with OpGuard():
        out = F.embedding(torch.tensor([1, 9, -6]), weight, padding_idx=padding_idx)
    assert torch.equal(out, weight[[1, row, row]])


def test_bad_indices_become_zero_and_scatter_keeps_in_place_semantics() -> None:
    target = torch.zeros(2, 3)
    with OpGuard():
        out = target.scatter_add_(1, torch.tensor([[5], [2]]), torch.ones(2, 1))
    assert out is target
    assert torch.equal(target, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))
    with OpGuard():
        assert torch.equal(F.one_hot(torch.tensor([-1, 1]), 2), torch.tensor([[1, 0], [0, 1]]))


def test_bad_multinomial_rows_become_uniform() -> None:
    probs = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    with OpGuard():
        torch.manual_seed(0)
        samples = torch.multinomial(probs, 400, replacement=True)
    assert set(samples[0].tolist()) == {0, 1, 2, 3}
    assert set(samples[1].tolist()) == {2}


def test_large_integer_indices_are_judged_exactly() -> None:
    size = 2**24 + 2
    source = torch.zeros(size, dtype=torch.uint8)
    guard = OpGuard()
    with guard:
        torch.index_select(source, 0, torch.tensor([size - 1, size]))
    info = OpGuard.describe(guard.records[0])
    assert (info["count"], info["first_indices"], info["max"]) == (1, [[1]], float(size))


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
