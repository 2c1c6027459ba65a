"""Arguments with a history: the deprecated ``warn=`` alias of ``emit_warnings``."""

from __future__ import annotations

import warnings

import pytest

from lightning_numguard import NumGuardCallback, NumGuardConfigError
from tests.helpers import FaultData, FaultModel, loader, trainer


def test_warn_is_a_deprecated_alias_of_emit_warnings():
    with pytest.warns(FutureWarning, match=r"warn=\.\.\.\) is deprecated .* use emit_warnings"):
        guard = NumGuardCallback(warn=False)
    assert guard.emit_warnings is False


def test_emit_warnings_false_keeps_events_but_warns_nothing(tmp_path):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), emit_warnings=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [guard], max_steps=5).fit(FaultModel(), loader(FaultData(bad_batch=3, site="input")))
    assert guard.events and guard.events[0]["kind"] == "nonfinite_input"
    assert not [w for w in caught if "NumGuard:" in str(w.message)]


def test_a_bad_warn_value_names_the_argument():
    with pytest.raises(NumGuardConfigError, match=r"`warn` must be True or False, got 'yes'"):
        NumGuardCallback(warn="yes")  # type: ignore[arg-type]
