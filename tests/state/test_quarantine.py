"""Quarantine keys, matching a batch against the quarantine, and its state."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_numguard.state.quarantine import Quarantine, index_tensor, parse_state, position_key, sample_indices


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ({"x": torch.zeros(2), "index": torch.tensor([4, 5])}, [4, 5]),
        ({"x": torch.zeros(2), "idx": torch.tensor([[1], [2]])}, [1, 2]),
        ({"x": torch.zeros(2), "index": torch.tensor([0.0, 1.0])}, None),  # a float "index" is data
        ({"x": torch.zeros(2), "index": torch.tensor([True, False])}, None),
        ((torch.zeros(2), torch.tensor([1, 2])), None),  # a tuple carries no named indices
        ({"x": torch.zeros(2)}, None),
    ],
)
def test_sample_indices(batch, expected):
    assert sample_indices(batch) == expected
    assert (index_tensor(batch) is None) == (expected is None)


@pytest.mark.parametrize(
    ("batch", "batch_idx", "key"),
    [
        ({"index": torch.tensor([7, 8])}, 3, "samples:7,8"),
        ({"x": torch.zeros(1)}, 3, "batch:3"),
    ],
)
def test_position_key(batch, batch_idx, key):
    assert position_key(batch, batch_idx) == key


def entry(batch_idx: int, step: int, samples: list[int] | None) -> dict:
    return {"epoch": 0, "batch_idx": batch_idx, "step": step, "reason": "test", "sample_indices": samples}


# quarantined entries, the new batch, its position and step -> flagged (None: cannot tell)
MATCHES = [
    ([], {"index": torch.tensor([1])}, 0, 5, None),
    ([entry(3, 3, [24, 25])], {"index": torch.tensor([25, 40])}, 9, 20, 1.0),  # any quarantined sample
    ([entry(3, 3, [24, 25])], {"index": torch.tensor([40, 41])}, 3, 20, 0.0),  # same position, other samples
    ([entry(3, 3, None)], {"x": torch.zeros(1)}, 3, 20, 1.0),  # by position, in a later epoch
    ([entry(3, 3, None)], {"x": torch.zeros(1)}, 3, 3, None),  # not the very step it was made at
    ([entry(3, 3, None)], {"x": torch.zeros(1)}, 4, 20, None),
]


@pytest.mark.parametrize(("entries", "batch", "batch_idx", "step", "expected"), MATCHES)
def test_flag(entries, batch, batch_idx, step, expected):
    q = Quarantine()
    for e in entries:
        q.add(e)
    flag = q.flag(batch, batch_idx, step)
    assert (None if flag is None else float(flag)) == expected


def test_add_keeps_one_entry_per_position_and_counts_failures():
    q = Quarantine()
    assert q.add(entry(3, 3, None)) and not q.add(entry(3, 9, None))
    assert q.holds(3) and not q.holds(4)
    assert [q.count_failure("batch:3") for _ in range(3)] == [1, 2, 3]


def test_state_round_trip_and_pickle():
    q = Quarantine()
    q.add(entry(3, 3, [24, 25]))
    q.count_failure("samples:24,25")
    state = q.state_dict()
    again = Quarantine()
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert pickle.loads(pickle.dumps(again)).state_dict() == state
    assert float(again.flag({"index": torch.tensor([25])}, 0, 9)) == 1.0  # the device cache is rebuilt


@pytest.mark.parametrize(
    ("key", "raw", "error"),
    [
        ("quarantined", [{"epoch": 0}], TypeError),
        ("quarantined", 5, TypeError),
        ("position_incidents", {"batch:3": None}, TypeError),
        ("position_incidents", {"batch:3": "x"}, ValueError),
        ("position_incidents", [1, 2], AttributeError),
    ],
)
def test_parse_state_refuses_malformed_parts(key, raw, error):
    with pytest.raises(error):
        parse_state(key, raw)
