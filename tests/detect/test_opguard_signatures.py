"""Tests of ``lightning_numguard.detect.opguard.signatures``: the tolerant table of op forms.

A private binding (``torch._C._nn.*``) renamed or removed by a torch release must not break
``import lightning_numguard``: the table leaves that form out, logs it once at DEBUG, and
every other form still guards.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_numguard.detect.opguard import OpGuard, signatures
from lightning_numguard.detect.opguard.signatures import FORMS, _build_forms
from tests.detect.test_opguard import CASES, CPU, Case, _logits

REPO = Path(__file__).resolve().parents[2]
RAW = torch._C._nn
LOGGER = "lightning_numguard.detect.opguard.signatures"


def _namespace_without(namespace: object, *missing: str) -> types.SimpleNamespace:
    """A copy of ``namespace``'s public names, less ``missing``: a torch where they were renamed."""
    names = (name for name in dir(namespace) if not name.startswith("__") and name not in missing)
    return types.SimpleNamespace(**{name: getattr(namespace, name) for name in names})


def _nll_loss2d_call(target: torch.Tensor) -> torch.Tensor:
    return RAW.nll_loss2d(torch.zeros(1, 3, 2, 2).log_softmax(1), target)


GOOD_2D_TARGET = torch.tensor([[[0, 1], [2, 0]]])
BAD_2D_TARGET = torch.tensor([[[0, 1], [5, 0]]])


def test_cross_entropy_is_recorded_once_and_probability_targets_are_skipped() -> None:
    guard = OpGuard()
    probs = torch.full((2, 10), 0.1)
    with guard:
        loss = F.cross_entropy(_logits(2), probs)
        F.cross_entropy(_logits(2), torch.tensor([1, 2]))
    torch.testing.assert_close(loss, F.cross_entropy(_logits(2), probs))
    assert [r.op for r in guard.records] == ["cross_entropy"]


def test_the_table_holds_every_form_of_this_torch() -> None:
    assert RAW.nll_loss2d in FORMS
    assert {form.op for form in FORMS.values()} == {case.op for case in CASES}
    assert len(FORMS) == 25


def test_a_missing_binding_is_left_out_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        forms = _build_forms(_namespace_without(RAW, "nll_loss2d", "cross_entropy_loss"))
    assert set(forms) == set(FORMS) - {RAW.nll_loss2d, RAW.cross_entropy_loss}
    assert all(forms[func] == FORMS[func] for func in forms)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 1
    assert "torch._C._nn.nll_loss2d, torch._C._nn.cross_entropy_loss" in messages[0]
    assert caplog.records[0].levelno == logging.DEBUG


def test_a_complete_namespace_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        forms = _build_forms(RAW)
    assert set(forms) == set(FORMS)
    assert [r for r in caplog.records if r.name == LOGGER] == []


def test_without_any_raw_binding_and_a_functional_missing_one_hot() -> None:
    forms = _build_forms(None, functional=_namespace_without(F, "one_hot"))
    raw = {RAW.binary_cross_entropy, RAW.nll_loss, RAW.nll_loss_nd, RAW.nll_loss2d, RAW.cross_entropy_loss}
    assert set(forms) == set(FORMS) - raw - {F.one_hot}


@pytest.mark.parametrize("case", [c for c in CASES if "torch._C._nn" not in c.id], ids=lambda c: c.id)
def test_other_forms_still_guard_with_a_binding_missing(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signatures, "FORMS", _build_forms(_namespace_without(RAW, "nll_loss2d")))
    guard = OpGuard()
    with guard:
        case.invalid()
    expected_flags = torch.zeros(case.records)
    expected_flags[case.flagged] = 1.0
    assert torch.equal(guard.flags(CPU), expected_flags)


def test_the_missing_form_is_the_only_one_unguarded(monkeypatch: pytest.MonkeyPatch) -> None:
    guard = OpGuard()
    with guard:
        _nll_loss2d_call(BAD_2D_TARGET)  # the full table guards the raw binding
        torch._C._nn.nll_loss(_logits().log_softmax(1), torch.tensor([1, 10, 2]))
    assert guard.flags(CPU).tolist() == [1.0, 1.0]

    monkeypatch.setattr(signatures, "FORMS", _build_forms(_namespace_without(RAW, "nll_loss2d")))
    guard = OpGuard()
    with guard:
        _nll_loss2d_call(GOOD_2D_TARGET)
        with pytest.raises(IndexError, match="Target 5 is out of bounds"):
            _nll_loss2d_call(BAD_2D_TARGET)
        torch._C._nn.nll_loss(_logits().log_softmax(1), torch.tensor([1, 10, 2]))
    assert [(r.op, r.flag.item()) for r in guard.records] == [("nll_loss", True)]


def test_import_lightning_numguard_survives_a_renamed_binding() -> None:
    """A fresh interpreter whose torch lacks two ``torch._C._nn`` bindings imports and guards."""
    body = textwrap.dedent(
        """
        import logging
        import torch
        import torch.nn.functional as F

        del torch._C._nn.nll_loss2d, torch._C._nn.binary_cross_entropy
        logging.basicConfig(level=logging.DEBUG, format="LOG %(levelname)s %(name)s %(message)s")
        import lightning_numguard
        from lightning_numguard.detect.opguard import OpGuard

        guard = OpGuard()
        with guard:
            F.cross_entropy(torch.zeros(2, 10), torch.tensor([3, 10]))
        print("FLAGS", guard.flags(torch.device("cpu")).tolist())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", body], cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FLAGS [1.0]" in result.stdout
    log_lines = [line for line in result.stderr.splitlines() if line.startswith("LOG DEBUG " + LOGGER)]
    assert len(log_lines) == 1, result.stderr[-3000:]
    assert "torch._C._nn.binary_cross_entropy, torch._C._nn.nll_loss2d" in log_lines[0]
