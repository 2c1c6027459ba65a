"""Each step's start RNG state: each generator's while the fit draws from it (``state/rng.py``)."""

from __future__ import annotations

import random

import torch

from lightning_numguard.state.rng import StepRng, moved, rng_state, set_rng_state


def _starts(rng: StepRng, steps: int, draws: dict[int, str] | None = None) -> list[set[str]]:
    """The generators each of ``steps`` step starts kept; a step in ``draws`` draws from the one it names."""
    kept = []
    for step in range(1, steps + 1):
        kept.append(set(rng.at_step_start()))
        source = (draws or {}).get(step)
        if source == "python":
            random.random()
        elif source == "torch":
            torch.rand(1)
    return kept


def test_a_fit_that_draws_from_no_generator_keeps_them_on_the_probe_and_recheck_steps_only():
    rng = StepRng()
    kept = _starts(rng, 60)
    assert [i + 1 for i, k in enumerate(kept) if k] == [1, 2, 3, 25, 50]
    assert all(k == {"torch", "python"} for k in kept if k) and rng.drawn == ()


def test_a_generator_seen_moving_on_the_probe_steps_is_kept_at_every_later_step_and_only_it():
    rng = StepRng()
    kept = _starts(rng, 40, {2: "python"})
    assert rng.drawn == ("python",)
    assert kept[3:] == [{"python"}] * 21 + [{"torch", "python"}] + [{"python"}] * 15  # step 25 looks at torch again
    rng = StepRng()
    _starts(rng, 10, dict.fromkeys(range(1, 11), "torch"))
    assert rng.drawn == ("torch",)


def test_a_fit_that_starts_drawing_later_is_seen_at_the_next_recheck():
    rng = StepRng()
    kept = _starts(rng, 60, dict.fromkeys(range(10, 61), "python"))
    # steps 10 to 24 drew: step 25 finds Python's state moved since step 3, and from there on every step keeps it
    assert ["python" in k for k in kept] == [True] * 3 + [False] * 21 + [True] * 36 and rng.drawn == ("python",)


def test_a_state_restores_the_generators_it_holds_and_leaves_the_others_as_they_are():
    state = rng_state(("torch", "cuda"))
    assert set(state) == {"torch"}
    expected = torch.rand(3)
    random.seed(5)
    python = random.getstate()
    set_rng_state(state)
    assert torch.equal(torch.rand(3), expected) and random.getstate() == python
    full = rng_state()
    random.random()
    assert moved(full) == ["python"]
    set_rng_state(full)
    assert random.getstate() == full["python"] and moved(full) == []
    set_rng_state({})  # a step that kept nothing: nothing to put back
    assert moved(full) == []
