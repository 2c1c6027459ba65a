"""Rollbacks that repeat, keyed by the place of their trouble (issue 33): a loop across snapshots is a repeat."""

from __future__ import annotations

from lightning_numguard.decide.repeats import Place, Repeats


def test_the_same_trouble_at_the_same_schedule_position_is_a_repeat_whichever_snapshot():
    repeats = Repeats()
    glitch = Place("nonfinite_param", "net.0.weight", (5,), "batch:5")
    assert repeats.add(4, glitch, 5, 0.01) is None  # the first rollback
    assert repeats.times_at(Place("nonfinite_param", "net.0.weight", (5,), "batch:7")) == (1, "schedule")
    again = repeats.add(6, Place("nonfinite_param", "net.0.weight", (5,), "batch:7"), 7, 0.01)
    assert again is not None and again["times"] == 2 and again["steps"] == [5, 7]  # another snapshot, the same place
    assert "a repeat (2 rollbacks for nonfinite_param at `net.0.weight` at LR schedule position 5" in again["said"]
    assert repeats.times_at(glitch) == (2, "schedule")  # a third there halts (judge)


def test_the_same_batch_is_a_place_and_other_troubles_or_places_are_not_repeats():
    repeats = Repeats()
    assert repeats.add(3, Place("nonfinite_input", "batch['x']", (3,), "samples:1,2"), 3, 0.1) is None
    same_batch = repeats.add(9, Place("nonfinite_input", "batch['x']", (9,), "samples:1,2"), 9, 0.1)
    assert same_batch is not None and "on the same batch (samples:1,2)" in same_batch["said"]
    assert repeats.add(12, Place("nonfinite_input", "batch['y']", (12,), "samples:1,2"), 12, 0.1) is None
    assert repeats.add(15, Place("nonfinite_loss", "loss", (), "samples:3"), 15, 0.1) is None
    assert repeats.add(18, Place("nonfinite_loss", "loss", (), "samples:4"), 18, 0.1) is None  # no schedule: no key


def test_the_same_snapshot_for_the_same_kind_is_still_a_repeat():
    repeats = Repeats()
    assert repeats.add(20, Place("spike", "loss", (21,)), 21, 0.3) is None
    again = repeats.add(20, Place("spike", "loss", (23,)), 23, 0.3)
    assert (
        again is not None and again["times"] == 2 and "rollbacks to the snapshot of step 20 for spike" in again["said"]
    )
    assert repeats.times_at(Place("spike", "loss", (25,))) == (0, None)  # a new position: no halt
