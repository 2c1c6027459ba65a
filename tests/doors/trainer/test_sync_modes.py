"""Both read schedules check the same things: each check, run in a real Trainer once per ``sync_mode``, reports the
same events (kind, culprit, step).

What legitimately differs, and is normalised here:

* a deferred event is read one step late: ``details["deferred"]`` and ``details["read_at_step"]`` (the step after
  ``step``); ``step`` itself is the step that went bad in both modes;
* the deferred read runs no replay (the step's tensors are gone a step later), so a module output is named by its
  watched block; the immediate read narrows it to the leaf module and keeps the block in ``details["block"]``;
* only root causes are compared: an immediate read also lists the consequences it can still see (every gradient
  a NaN input ruined, the BatchNorm statistics it poisoned), a late one only those its kept records show;
* the gradients, parameters and buffers of the ``NORMS`` slot are gone or repaired a step later: a late read names
  the part that went non-finite ("a gradient", "a buffer") where the immediate read names the tensor;
* what is *done* may differ (a deferred step is skipped on the device, a rollback is carried out a step late, and
  the counts follow), so only what each mode *saw* at the step that went bad is compared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_numguard import NumGuardCallback
from tests.doors.trainer.test_zerosync import FusedModel
from tests.helpers import FaultData, loader, trainer

EVERY_CHECK = ["inputs", "outputs", "ops", "loss", "grads", "buffers", "params", "optimizer_state"]
SITES = ("input", "masked", "output", "op", "loss", "param", "opt_state")


class UnusedParameterModel(FusedModel):
    """A ``FusedModel`` with a layer in its optimizer that ``forward`` never uses: it never gets a gradient."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unused = nn.Linear(2, 2)


def fit(tmp_path: Any, mode: str, site: str | None, model: FusedModel | None = None) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = model if model is not None else FusedModel(site=site, step=3)
    kwargs: dict[str, Any] = {"check": EVERY_CHECK} if site in ("param", "opt_state") else {}
    guard = NumGuardCallback(
        action="rollback",
        snapshot_every_n_steps=1,
        dirpath=str(tmp_path / mode),
        sync_mode=mode,
        emit_warnings=False,
        **kwargs,
    )  # type: ignore[arg-type]
    data = FaultData(bad_batch=3 if site in ("input", "masked") else None, site=site or "input")
    trainer(tmp_path / mode, [guard], max_steps=6).fit(model, loader(data))
    return guard.events


def seen(events: list[dict[str, Any]], deferred: bool, step: int | None = None) -> set[tuple[int, str, str]]:
    """``(step, kind, culprit)`` of each event (of ``step`` only, when given); a module output by its block."""
    out = set()
    for e in events:
        if (step is not None and e["step"] != step) or not e.get("root_cause", True):
            continue
        where = e["details"].get("block", e["where"]) if e["kind"] == "nonfinite_output" else e["where"]
        out.add((e["step"], e["kind"], str(where)))
        if deferred and step is not None:  # read late, and says so
            assert e["details"]["deferred"] is True and e["details"]["read_at_step"] == e["step"] + 1, e
    return out


@pytest.mark.parametrize("site", SITES)
def test_each_check_reports_the_same_events_in_both_sync_modes(tmp_path, site):
    now = fit(tmp_path, "every_step", site)
    late = fit(tmp_path, "deferred", site)
    assert seen(now, False, 3), f"the {site} fault was not reported at its step"
    assert seen(now, False, 3) == seen(late, True, 3)


@pytest.mark.parametrize(
    ("site", "kind", "named", "late_named"),
    [
        ("grad", "nonfinite_grad", "head.weight", "a gradient"),
        ("buffer", "nonfinite_param", "body.2.running_var", "a buffer"),  # the buffers were put back on the device
    ],
)
def test_a_late_read_names_the_norms_slot_where_an_immediate_one_names_the_tensor(
    tmp_path, site, kind, named, late_named
):
    now = fit(tmp_path, "every_step", site)
    late = fit(tmp_path, "deferred", site)
    assert seen(now, False, 3) == {(3, kind, str([named]))}
    assert seen(late, True, 3) == {(3, kind, str([late_named]))}


def test_a_parameter_that_never_gets_a_gradient_is_reported_in_both_sync_modes(tmp_path):
    now = fit(tmp_path, "every_step", None, UnusedParameterModel())
    late = fit(tmp_path, "deferred", None, UnusedParameterModel())
    expected = {(0, "optimizer_coverage", str(["unused.weight", "unused.bias"]))}
    assert seen(now, False) == expected
    assert seen(late, True) == expected
    assert [e["details"]["code"] for e in late] == [e["details"]["code"] for e in now]
