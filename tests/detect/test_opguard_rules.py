"""Tests of ``lightning_numguard.detect.opguard.rules``: what each rule flags and what it puts in place."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.detect.opguard.rules import (
    ArgRule,
    check_class_targets,
    check_dim_index,
    check_distribution,
    check_embedding,
    check_one_hot,
    check_probabilities,
    fill_mask,
    violations,
)
from tests.detect.test_opguard import BCE_GOOD, BCE_TARGET, INF, NAN, _logits, _weight


class Args:
    """The arguments of a call by canonical name, as the rules read them."""

    def __init__(self, **values: Any) -> None:
        self.values = values

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)


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


def test_violations_is_an_elementwise_mask_per_rule() -> None:
    x = torch.tensor([0.0, 0.5, 1.0, 1.5, -0.1, NAN, INF])
    bce = violations("binary_cross_entropy", x, 0.0, 1.0, None)
    assert bce.tolist() == [False, False, False, True, True, True, True]
    index = torch.tensor([-100, -1, 0, 2, 3])
    assert violations("nll_loss", index, 0, 3, -100).tolist() == [False, True, False, False, True]
    assert violations("nll_loss", index, 0, 3, 1).tolist() == [True, True, False, False, True]
    assert violations("one_hot", index, 0, None, None).tolist() == [True, True, False, False, False]
    assert violations("gather", index, 0, 0, None).all()  # an empty dimension: every index is bad


def test_multinomial_violations_and_fill_cover_whole_rows() -> None:
    probs = torch.tensor([[0.2, 0.8], [0.0, 0.0], [NAN, 1.0]])
    bad = violations("multinomial", probs, 0.0, None, None)
    assert bad.tolist() == [[False, False], [True, True], [True, False]]
    assert fill_mask("multinomial", bad).tolist() == [[False], [True], [True]]
    assert fill_mask("gather", bad) is bad


def test_checks_return_the_argument_bounds_and_fill() -> None:
    logits, target = torch.zeros(2, 4), torch.tensor([1, 2])
    assert check_probabilities("binary_cross_entropy", Args(input=BCE_GOOD, target=BCE_TARGET)) == [
        ArgRule("input", "input in [0, 1]", 0.0, 1.0, 0.5),
        ArgRule("target", "target in [0, 1]", 0.0, 1.0, 0.5),
    ]
    assert check_class_targets("nll_loss", Args(input=logits, target=target, ignore_index=3)) == [
        ArgRule("target", "target in [0, 4) or == ignore_index (3)", 0, 4, 3, 3)
    ]
    assert check_embedding("embedding", Args(input=target, weight=_weight(), padding_idx=-2)) == [
        ArgRule("input", "index in [0, 5)", 0, 5, 3)
    ]
    assert check_dim_index("gather", Args(input=logits, dim=1, index=target)) == [
        ArgRule("index", "index in [0, 4) along dim 1", 0, 4, 0)
    ]
    assert check_one_hot("one_hot", Args(input=target, num_classes=3)) == [ArgRule("input", "value in [0, 3)", 0, 3, 0)]
    assert check_distribution("multinomial", Args(input=torch.ones(3))) == [
        ArgRule("input", "probabilities finite and >= 0, each row sum > 0", 0.0, None, 1.0)
    ]


def test_checks_skip_calls_the_op_rejects_by_itself() -> None:
    logits = torch.zeros(2, 4)
    assert check_class_targets("cross_entropy", Args(input=logits, target=torch.full((2, 4), 0.25))) == []
    assert check_embedding("embedding", Args(input=torch.tensor([0.5]), weight=_weight())) == []
    assert check_dim_index("gather", Args(input=logits, dim=5, index=torch.tensor([[0]]))) == []
    assert check_distribution("multinomial", Args(input=torch.ones(2, 2, 2))) == []
