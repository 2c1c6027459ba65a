"""Checks that look at a fit once, on the host (``Check.at_fit_start`` / ``at_first_optimizer_step``): the built-in
optimizer coverage is one (``detect/coverage_check.py``, listed once in ``registry.DEFAULTS``), and a user's is written
the same way (``tests/toy/small_norm_eps.py``), with real fits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_numguard import NumGuardCallback, NumGuardConfigError, NumGuardError
from lightning_numguard.detect import registry
from lightning_numguard.detect.coverage_check import OptimizerCoverage
from lightning_numguard.reporting.events import read_events
from tests.helpers import FaultData, FaultModel, loader, trainer
from tests.toy.small_norm_eps import SmallNormEps


class NormModel(FaultModel):
    """The suite's fault model with a LayerNorm of ``eps=1e-8`` in front (never constant here: the fit stays clean)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8, eps=1e-8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x))


def fit(tmp_path: Path, **kwargs: object) -> tuple[NumGuardCallback, BaseException | None]:
    torch.manual_seed(0)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), emit_warnings=False, **kwargs)  # type: ignore[arg-type]
    try:
        trainer(tmp_path, [guard], max_steps=3).fit(NormModel(), loader(FaultData()))
    except NumGuardError as err:
        return guard, err
    return guard, None


def test_the_optimizer_coverage_is_a_default_check_built_from_the_config() -> None:
    assert OptimizerCoverage in registry.DEFAULTS and isinstance(registry.CHECKS[0], OptimizerCoverage)
    assert registry.CHECKS[0].builtin and not registry.CHECKS[0].fused and registry.CHECKS[0].looks_at_fit
    assert all(c.fused for c in registry.CHECKS[1:])
    for mode, fatal in (("warn", False), ("error", True)):
        (check,) = registry.fit_checks(NumGuardCallback(check_optimizer_coverage=mode).config)
        assert isinstance(check, OptimizerCoverage) and check.fatal is fatal
    assert registry.fit_checks(NumGuardCallback(check_optimizer_coverage="off").config) == ()
    extra = SmallNormEps()
    assert registry.fit_checks(NumGuardCallback(extra_checks=[extra]).config)[1:] == (extra,)


def test_a_check_of_ones_own_looks_at_the_fit_once_and_reports_at_its_start(tmp_path: Path) -> None:
    guard, raised = fit(tmp_path, extra_checks=[SmallNormEps()])
    assert raised is None
    (event,) = guard.events
    assert (event["step"], event["kind"], event["where"], event["action"]) == (0, "small_norm_eps", ["norm"], "none")
    assert event["details"]["eps"] == {"norm": 1e-8} and event["details"]["check"] == "SmallNormEps"
    assert event["message"].startswith("normalisation layers with eps below 1e-06: `norm` at step 0 on rank 0")
    assert event["message"].endswith(SmallNormEps.hint)
    assert guard.counters["incidents"] == 0  # advisory: reported, never counted nor acted on
    written, bad = read_events(guard.resolved_dirpath / "events.jsonl")
    assert [e["kind"] for e in written] == ["small_norm_eps"] and not bad


def test_a_fatal_one_ends_the_fit_after_its_event_is_written(tmp_path: Path) -> None:
    guard, raised = fit(tmp_path, extra_checks=[SmallNormEps(fatal=True)])
    assert isinstance(raised, NumGuardError) and "eps below 1e-06: `norm`" in str(raised)
    written, _ = read_events(guard.resolved_dirpath / "events.jsonl")
    assert [e["kind"] for e in written] == ["small_norm_eps"]


def test_a_check_above_the_layers_eps_finds_nothing(tmp_path: Path) -> None:
    guard, raised = fit(tmp_path, extra_checks=[SmallNormEps(min_eps=1e-9)])
    assert raised is None and guard.events == []


def test_a_check_that_neither_records_nor_looks_at_the_fit_is_refused() -> None:
    class Idle(SmallNormEps):
        at_fit_start = registry.Check.at_fit_start  # type: ignore[assignment]

    with pytest.raises(NumGuardConfigError, match=r"records_at.*or overriding one of \['at_fit_start'"):
        NumGuardCallback(extra_checks=[Idle()])
