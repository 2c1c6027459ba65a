"""The op guard intercepts only the guarded functions, per thread, and always puts the originals back."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.detect.opguard import patch as opguard_patch

RAW = torch._C._nn
BAD_TARGET = torch.tensor([3, 10])


def _originals() -> dict[str, object]:
    return {
        "F.cross_entropy": F.cross_entropy,
        "F.one_hot": F.one_hot,
        "torch.gather": torch.gather,
        "torch.embedding": torch.embedding,
        "RAW.cross_entropy_loss": RAW.cross_entropy_loss,
        "RAW.one_hot": RAW.one_hot,
        "Tensor.gather": torch.Tensor.gather,
        "Tensor.scatter_": torch.Tensor.scatter_,
        "torch.add": torch.add,
        "Tensor.add": torch.Tensor.add,
    }


def test_only_the_guarded_functions_are_replaced_and_all_come_back() -> None:
    before = _originals()
    own = set(vars(torch.Tensor))
    with OpGuard():
        during = _originals()
        assert during["torch.add"] is before["torch.add"] and during["Tensor.add"] is before["Tensor.add"]
        replaced = {k for k in before if during[k] is not before[k]}
        assert replaced == set(before) - {"torch.add", "Tensor.add"}
        assert F.one_hot is RAW.one_hot  # one wrapper for one builtin, in every namespace that holds it
    assert _originals() == before
    assert set(vars(torch.Tensor)) == own  # Tensor methods inherited again, not re-set on the class
    assert opguard_patch._installed == {}


def test_originals_come_back_when_the_guarded_block_raises() -> None:
    before = _originals()
    guard = OpGuard()
    with pytest.raises(ZeroDivisionError), guard:
        F.cross_entropy(torch.zeros(2, 10), BAD_TARGET)
        _ = 1 / 0
    assert _originals() == before
    assert opguard_patch.active_guards() == []
    assert guard.flags(torch.device("cpu")).tolist() == [1.0]


def test_another_thread_is_not_guarded() -> None:
    guard = OpGuard()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            F.cross_entropy(torch.zeros(2, 10), BAD_TARGET)
        except BaseException as err:
            errors.append(err)

    with guard:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        F.cross_entropy(torch.zeros(2, 10), BAD_TARGET)  # this thread: defused and recorded
    assert len(errors) == 1 and isinstance(errors[0], IndexError)
    assert len(guard.records) == 1


def test_a_reference_taken_before_entering_still_reaches_a_guarded_binding() -> None:
    early = F.cross_entropy  # e.g. `self.loss_fn = F.cross_entropy` in a module's __init__
    guard = OpGuard()
    with guard:
        early(torch.zeros(2, 10), BAD_TARGET)
    assert [(r.op, bool(r.flag)) for r in guard.records] == [("cross_entropy", True)]


def test_nested_guards_record_in_the_innermost_and_restore_at_the_last_exit() -> None:
    before = _originals()
    outer, inner = OpGuard(), OpGuard(ops=["gather"])
    with outer:
        with inner:
            torch.gather(torch.zeros(2, 3), 1, torch.tensor([[0, 3]]))
            F.cross_entropy(torch.zeros(2, 10), BAD_TARGET)  # not the inner guard's op: the outer's
        assert torch.gather is not before["torch.gather"]  # the outer guard still needs it
        torch.gather(torch.zeros(2, 3), 1, torch.tensor([[0, 1]]))
    assert [r.op for r in inner.records] == ["gather"]
    assert [r.op for r in outer.records] == ["cross_entropy", "gather"]
    assert _originals() == before


def test_a_guarded_call_is_checked_once_not_again_in_the_functions_it_calls() -> None:
    guard = OpGuard()
    with guard:
        torch.nn.CrossEntropyLoss()(torch.zeros(2, 10), BAD_TARGET)  # F.cross_entropy -> raw binding
        torch.nn.BCELoss()(torch.tensor([0.5, 2.0]), torch.tensor([1.0, 0.0]))  # input and target
    assert [r.op for r in guard.records] == ["cross_entropy", "binary_cross_entropy", "binary_cross_entropy"]


def test_a_held_guard_keeps_the_functions_wrapped_between_entries_and_restores_on_release() -> None:
    before = _originals()
    guard = OpGuard()
    guard.hold()
    guard.hold()  # idempotent
    wrapped = F.cross_entropy
    assert wrapped is not before["F.cross_entropy"]
    with pytest.raises(IndexError):
        F.cross_entropy(torch.zeros(2, 10), BAD_TARGET)  # held, not entered: passes through
    for _ in range(2):
        with guard:
            F.cross_entropy(torch.zeros(2, 10), BAD_TARGET)
        assert F.cross_entropy is wrapped and opguard_patch.active_guards() == []
    with guard:  # released while entered: the originals come back at once, the exit is still clean
        guard.release()
    guard.release()
    assert len(guard.records) == 2
    assert _originals() == before and opguard_patch._installed == {}
