"""The replay's search for the first bad module, forward op and autograd node, given a closure."""

from __future__ import annotations

import random

import torch
from torch import nn

from lightning_numguard.diagnose.replay import first_bad_node, loss_of, replay
from lightning_numguard.state.rng import rng_state


class ZeroStdNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean()) / x.std()  # a constant input: 0 / 0


class SqrtNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * 0).sum(-1, keepdim=True)) + x  # finite forward, sqrt(0)'s backward is Inf


def test_loss_of():
    t = torch.ones(())
    assert loss_of(t) is t and loss_of({"loss": t}) is t
    assert loss_of(None) is None and loss_of({"other": t}) is None


def test_a_forward_division_by_zero_std_is_named_with_its_module_and_op():
    model = nn.Sequential(nn.Linear(4, 4), ZeroStdNorm(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)  # constant activations
    x = torch.randn(3, 4)
    result = replay(model, lambda: model(x).sum())
    assert result.forward_module == "1"
    assert result.forward_op == "div" and result.forward_op_module == "1"
    assert all(p.grad is None for p in model.parameters())  # the replay leaves no gradients


def test_a_backward_only_inf_is_named_by_its_autograd_node_and_user_line():
    model = nn.Sequential(nn.Linear(4, 4), SqrtNorm())
    x = torch.randn(2, 4)
    result = first_bad_node(lambda: model(x).sum())
    assert result["op"] == "SqrtBackward0"
    assert "test_replay.py" in result["forward_trace"] and "sqrt" in result["forward_trace"]
    full = replay(model, lambda: model(x).sum())
    assert "forward_op" not in full.details() and full.op == "SqrtBackward0"


def test_a_clean_step_names_nothing_and_a_raising_step_is_reported_not_raised():
    model = nn.Linear(2, 1)
    x = torch.randn(3, 2)
    clean = replay(model, lambda: model(x).sum())
    assert clean.details() == {"reproduced": False} and clean.stage is None  # it ran, and nothing came back
    assert clean.again is False and replay(model, lambda: model(x).sum() * float("nan")).again is True

    def boom() -> torch.Tensor:
        raise RuntimeError("user code failed")

    raised = replay(model, boom)
    assert raised.error == "RuntimeError: user code failed" and raised.again is None  # no verdict on a raise


def test_the_replay_restores_the_rng_it_was_given_and_the_one_it_found():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    x = torch.randn(4, 2)
    rng = {"torch": torch.get_rng_state(), "python": __import__("random").getstate()}
    before = torch.get_rng_state()
    drawn: list[torch.Tensor] = []
    replay(model, lambda: (drawn.append(torch.rand(1)), model(x).sum())[1], rng)
    assert torch.equal(drawn[0], drawn[1])  # both passes start from the same RNG state
    assert torch.equal(torch.get_rng_state(), before)


def test_every_fact_measured_at_the_culprit_is_a_field_of_the_replays_record():
    """A fact the replay measures but its record has no field for would be dropped from the events silently."""
    from dataclasses import fields

    from lightning_numguard.diagnose.replay import CULPRIT_FACTS, Replay

    assert set(CULPRIT_FACTS) <= {f.name for f in fields(Replay)}
    assert Replay.of({"stage": "forward", "made": "inf", "unknown": 1}).details() == {"stage": "forward", "made": "inf"}


def test_a_replay_that_draws_from_python_random_without_its_state_proves_nothing_when_it_stays_finite():
    """The step's start kept torch's RNG state alone (the fit had not been seen drawing from Python's): a replay that
    draws from ``random`` did not run the step again exactly, so its finite result is no verdict; with Python's state
    kept, the same replay stays finite and says so."""
    model = nn.Sequential(nn.Linear(2, 2))
    x = torch.randn(4, 2)

    def step() -> torch.Tensor:
        return model(x * random.random()).sum()

    unsure = replay(model, step, rng_state(("torch", "cuda")))
    assert unsure.unsure is not None and "Python's random" in unsure.unsure
    assert unsure.reproduced is None and unsure.again is None
    exact = replay(model, step, rng_state())
    assert exact.unsure is None and exact.reproduced is False and exact.again is False
    untouched = replay(model, lambda: model(x).sum(), rng_state(("torch", "cuda")))  # no draw: exact without it
    assert untouched.unsure is None and untouched.again is False
