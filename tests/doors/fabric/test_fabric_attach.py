"""The Fabric factory's own errors; ``Fabric`` objects of both packages built under each environment are in
``tests/test_attach.py`` (beside the Trainer's), and LitGPT's in ``test_litgpt.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_numguard.doors.fabric import attach as fabric_attach
from lightning_numguard.errors import NumGuardConfigError


def test_an_argument_the_fabric_guard_does_not_take_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = tmp_path / "g.yaml"
    monkeypatch.delenv("NUMGUARD", raising=False)
    monkeypatch.setenv("NUMGUARD_CONFIG", str(cfg))
    cfg.write_text("acton: skip\n")
    with pytest.raises(NumGuardConfigError, match=r"g\.yaml' names an argument NumGuard does not take.*acton"):
        fabric_attach.fabric_callbacks()
    cfg.write_text("sync_mode: deferred\n")
    with pytest.raises(
        NumGuardConfigError, match=r"does not apply to a Fabric loop.*\(from NUMGUARD_CONFIG='.*g\.yaml'\)"
    ):
        fabric_attach.fabric_callbacks()
    monkeypatch.delenv("NUMGUARD_CONFIG")
    assert fabric_attach.fabric_callbacks() == []
