"""Tests of ``lightning_numguard.detect.opguard``: every guarded op form, valid and invalid, on CPU.

The case table here is shared with ``test_opguard_rules.py`` (what each rule replaces),
``test_opguard_signatures.py`` (the tolerant table of op forms) and ``test_opguard_mode.py``
(records, flags, ``describe``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_numguard.detect.opguard import GUARDED_OPS, OpGuard
from lightning_numguard.reporting.hints import OP_DOMAIN_HINTS

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


def _same(a: Any, b: Any, nan_equal: bool = False) -> bool:
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        if nan_equal and a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    return all(_same(x, y, nan_equal) for x, y in zip(a, b, strict=True))


@pytest.fixture
def no_sync() -> Iterator[None]:
    """Count every Python-level way of reading a tensor on the host during the test; none may happen."""
    from instruments.syncs import SyncCounter

    with SyncCounter(copies_from_cpu=True) as counter:
        with counter.step():
            bool(torch.tensor(True))
        assert counter.step_total == [1]  # the counter is live
        with counter.step():
            yield
    assert counter.step_total == [1, 0], f"host sync on the hot path: {dict(counter.sites)}"


def test_cases_cover_every_guarded_op() -> None:
    assert {case.op for case in CASES} == GUARDED_OPS
    assert set(OP_DOMAIN_HINTS) == GUARDED_OPS
    assert all(OP_DOMAIN_HINTS.values())


@pytest.mark.parametrize(
    ("op", "advice"),
    [
        ("binary_cross_entropy", "use BCEWithLogitsLoss"),
        ("nll_loss", "a target class index is negative or not smaller than the number of classes"),
        ("cross_entropy", "mark padding with ignore_index (default -100)"),
        ("embedding", "a token id is negative or not smaller than num_embeddings"),
        ("embedding_bag", "clamp out-of-vocabulary ids to an UNK id"),
        ("gather", "check the `dim` argument"),
        ("scatter", "these ops do not wrap negative indices"),
        ("scatter_add", "not smaller than the size of the indexed dimension"),
        ("index_select", "not smaller than the size of the indexed dimension"),
        ("one_hot", "pass a num_classes that covers the label range"),
        ("multinomial", "sample from softmax(logits)"),
    ],
)
def test_each_op_has_its_own_advice_in_reporting(op: str, advice: str) -> None:
    """The advice moved out of ``core`` (``describe`` no longer has a ``hint``), texts unchanged."""
    assert advice in OP_DOMAIN_HINTS[op]


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
    assert "hint" not in info  # prose lives in reporting: the op's advice is OP_DOMAIN_HINTS[op]
    assert OP_DOMAIN_HINTS[case.op]
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
    guard.module_resolver = lambda: "model.head"
    with guard:
        for case in CASES:
            case.valid()
            case.invalid()
    flags = guard.flags(CPU)
    assert flags.shape == (sum(2 * case.records for case in CASES),)


# ---------------------------------------------------------------- CPU calls run first (check_cpu_calls=False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_clean_cpu_call_runs_unchecked_when_the_kernel_checks_it(case: Case) -> None:
    """NumGuardCallback's mode: a clean CPU call leaves no record (in-place forms are still checked first)."""
    expected = case.valid()
    guard = OpGuard(check_cpu_calls=False)
    with guard:
        got = case.valid()
    assert _same(got, expected)
    assert not any(bool(r.flag) for r in guard.records)
    assert len(guard.records) == (case.records if case.id.endswith("_") else 0)  # Tensor.scatter_: checked first


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_bad_cpu_call_is_recorded_and_defused_after_its_kernel_raised(case: Case) -> None:
    """The same record and the same sanitised result as checking first."""
    first = OpGuard()
    with first:
        expected = case.invalid()
    guard = OpGuard(check_cpu_calls=False)
    with guard:
        got = case.invalid()
    assert _same(got, expected, nan_equal=True)  # a mean over only replaced targets is NaN either way
    assert len(guard.records) == case.records
    assert torch.equal(guard.flags(CPU), first.flags(CPU))
    assert OpGuard.describe(guard.records[case.flagged]) == OpGuard.describe(first.records[case.flagged])


def test_a_cpu_error_no_rule_explains_is_raised_as_it_was() -> None:
    logits, target = torch.zeros(3, 4), torch.tensor([1, 2])  # a batch-size mismatch, not a domain error
    with pytest.raises(ValueError) as unguarded:
        F.cross_entropy(logits, target)
    guard = OpGuard(check_cpu_calls=False)
    with guard, pytest.raises(ValueError) as guarded:
        F.cross_entropy(logits, target)
    assert str(guarded.value) == str(unguarded.value)
    assert guard.records == []


def test_in_place_forms_are_checked_before_they_run_on_the_cpu() -> None:
    """``scatter_`` may write part of its output before its kernel raises: it is never run first."""
    out = torch.zeros(4)
    guard = OpGuard(check_cpu_calls=False)
    with guard:
        out.scatter_(0, torch.tensor([1, 7]), torch.ones(2))
    assert len(guard.records) == 1 and bool(guard.records[0].flag)
    assert torch.equal(out, torch.tensor([1.0, 1.0, 0.0, 0.0]))  # the bad index became 0; nothing else written
