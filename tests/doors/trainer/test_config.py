"""Arguments with a history: ``emit_warnings`` and the removed ``warn=`` alias."""

from __future__ import annotations

import inspect
import warnings

import pytest

from lightning_numguard import NumGuardCallback, NumGuardConfigError
from tests.helpers import FaultData, FaultModel, loader, trainer


def test_the_removed_warn_alias_is_refused():
    """``warn=`` (a deprecated alias of ``emit_warnings`` whose name clashed with ``action="warn"``) is gone."""
    assert "warn" not in inspect.signature(NumGuardCallback).parameters
    with pytest.raises(TypeError, match="'warn'"):
        NumGuardCallback(warn=False)  # type: ignore[call-arg]


def test_emit_warnings_false_keeps_events_but_warns_nothing(tmp_path):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), emit_warnings=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [guard], max_steps=5).fit(FaultModel(), loader(FaultData(bad_batch=3, site="input")))
    assert guard.events and guard.events[0]["kind"] == "nonfinite_input"
    assert not [w for w in caught if "NumGuard:" in str(w.message)]


def test_a_bad_emit_warnings_value_names_the_argument():
    with pytest.raises(NumGuardConfigError, match=r"`emit_warnings` must be True or False, got 'yes'"):
        NumGuardCallback(emit_warnings="yes")  # type: ignore[arg-type]
