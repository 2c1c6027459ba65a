"""The benchmark's floor (``instruments.floor.FloorGuard``) is a real check: it must see what it claims to read."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from instruments.floor import FloorGuard
from lightning_numguard.detect.watch import select_modules
from tests.helpers import FaultData, FaultModel, all_finite, loader, trainer


def _fit(tmp_path: Any, site: str | None, every: bool = False) -> tuple[FloorGuard, FaultModel]:
    floor = FloorGuard(every=every)
    model = FaultModel(site=site, step=3)
    data = FaultData(bad_batch=3 if site == "input" else None, site=site or "input")
    trainer(tmp_path, [floor], max_steps=6).fit(model, loader(data))
    return floor, model


@pytest.mark.parametrize("every", [False, True])
def test_a_clean_fit_sees_nothing(tmp_path: Any, every: bool) -> None:
    floor, model = _fit(tmp_path, None, every)
    assert floor.bad_steps == 0
    assert model.fired == 0


@pytest.mark.parametrize("site", ["input", "grad", "loss", "param", "opt_state"])
def test_the_floor_sees_each_value_it_reads(tmp_path: Any, site: str) -> None:
    every = site in ("param", "opt_state")  # read every step only with every=True
    floor, model = _fit(tmp_path, site, every)
    assert floor.bad_steps >= 1
    if site in ("grad", "loss"):  # the step's gradients were dropped: nothing bad was applied
        assert floor.bad_steps == 1
        assert all_finite(model.state_dict())
    if site == "input":  # the BatchNorm statistics stay NaN (the floor cannot restore them): seen every step after
        assert floor.bad_steps == 3
        assert all_finite({k: v for k, v in model.state_dict().items() if "running" not in k})


def test_the_floor_hooks_the_blocks_the_guards_watch_selects(tmp_path: Any) -> None:
    model = FaultModel()
    floor = FloorGuard()
    floor.setup(None, model, "fit")
    try:
        assert len(floor._handles) == len(select_modules(model, depth=1)) > 0
        model.body[1].armed = True  # the poisoned block's output is NaN
        model(torch.randn(4, 8))
        assert 0 < len(floor._outputs) <= len(floor._handles)  # the metric module is hooked but has no forward here
        assert not bool(torch.isfinite(torch.stack(floor._outputs)).all())
    finally:
        floor.teardown(None, model, "fit")
    assert not model.body[1]._forward_hooks


def test_the_floor_without_outputs_hooks_nothing_and_still_sees_the_gradients(tmp_path: Any) -> None:
    model = FaultModel()
    floor = FloorGuard(outputs=False)
    floor.setup(None, model, "fit")
    assert floor._handles == []
    floor.teardown(None, model, "fit")
    floor = FloorGuard(outputs=False)
    trainer(tmp_path, [floor], max_steps=6).fit(FaultModel(site="grad", step=3), loader(FaultData(site="grad")))
    assert floor.bad_steps == 1
