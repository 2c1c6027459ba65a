"""The RNG states a step starts from: what a replay of the step, a retry and a snapshot put back.

:func:`rng_state` reads torch's CPU generator, CUDA's (when initialised) and Python's ``random``; :func:`set_rng_state`
puts back what a state holds. :class:`StepRng` is what each step's start keeps: each generator's state while the fit
draws from it. A training step seldom draws from most of them (an LLM without dropout draws from none; dropout on a
GPU draws from CUDA's, never the CPU's), and reading them is a large part of the guard's host work on a small step:
Python's state is 625 ints built anew, torch's a tensor copy of the generator, CUDA's one per visible device. A
state without a generator's leaves that generator as it is when put back; a replay from such a state that draws from
it says it could not run the step again exactly (:func:`~lightning_numguard.diagnose.replay.replay`) instead of
claiming that the fault did not come back.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["NAMES", "SOURCES", "StepRng", "copy_rng", "moved", "rng_state", "set_rng_state"]

#: The generators a state may hold, by key.
SOURCES = ("torch", "python", "cuda")
#: What the events call each of them.
NAMES = {"torch": "torch's CPU generator", "python": "Python's random", "cuda": "the CUDA generators"}


def _cuda() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_available()  # the cheap test first: this runs every step


def _read(source: str) -> Any:
    if source == "torch":
        return torch.get_rng_state()
    if source == "python":
        return random.getstate()
    return torch.cuda.get_rng_state_all()


def rng_state(sources: tuple[str, ...] = SOURCES) -> dict[str, Any]:
    """The states of the generators ``sources`` names (all: torch's CPU, Python's, CUDA's when initialised)."""
    return {s: _read(s) for s in sources if s != "cuda" or _cuda()}


def copy_rng(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of what :func:`rng_state` returned that a snapshot can keep: a new dict (and list of CUDA states) of the
    same values, which nothing writes to (``torch.get_rng_state`` returns a new tensor, Python's state is a tuple).
    A deep copy walked Python's 625-int tuple one element at a time: half of a small model's snapshot."""
    return {k: list(v) if isinstance(v, list) else v for k, v in state.items()}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned: each generator the state holds (the others are left as they are)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(torch.equal, a, b))
    return a == b


def moved(before: Mapping[str, Any]) -> list[str]:
    """The generators of ``before`` (what :func:`rng_state` returned earlier) whose state is not the same now."""
    return [s for s, value in before.items() if not _same(value, _read(s))]


class StepRng:
    """The RNG state kept at each step's start, for one fit: each generator's while the fit draws from it.

    The first :attr:`PROBE` steps keep every generator's state, and so does one step in every :attr:`RECHECK`; each
    compares a generator's state with the last one kept. Once a generator's state has moved (the step, or the batch
    fetch between steps, drew from it), every later step keeps it, for the rest of the fit (:attr:`drawn`).
    """

    #: the first steps of a fit that keep every generator's state
    PROBE = 3
    #: after them, one step in this many keeps every generator's state and looks again
    RECHECK = 25

    __slots__ = ("_last", "drawn", "steps")

    def __init__(self) -> None:
        self.steps = 0
        self.drawn: tuple[str, ...] = ()  # the generators seen moving: kept at every step
        self._last: dict[str, Any] = {}

    def at_step_start(self) -> dict[str, Any]:
        """The RNG state of the step starting now (see the class)."""
        self.steps = steps = self.steps + 1
        if steps > self.PROBE and steps % self.RECHECK:  # the usual step: the generators seen moving
            return rng_state(sources=self.drawn) if self.drawn else {}
        state = rng_state()
        for source, value in state.items():
            if source in self.drawn:
                continue
            last = self._last.get(source)
            if last is not None and not _same(last, value):
                self.keep(source)
            else:
                self._last[source] = value
        return state

    def keep(self, source: str) -> None:
        """Keep ``source``'s state at every step from now on (it was seen moving)."""
        if source not in self.drawn:
            self.drawn = tuple(s for s in SOURCES if s in self.drawn or s == source)
            self._last.pop(source, None)
