"""The guard's own logging (progress-bar entries, counters, AMP scalars) makes Lightning warn about nothing."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar
from pytorch_lightning.loggers import CSVLogger

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import FaultData, FaultModel, loader, trainer


@pytest.mark.parametrize("bar_class", [TQDMProgressBar, RichProgressBar])
def test_a_run_with_an_incident_makes_lightning_warn_about_nothing_the_guard_logged(
    tmp_path: Path, bar_class: type
) -> None:
    """Every value the guard hands to ``self.log`` is already what Lightning wants (a float tensor, one element)."""
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"), replay=False)
    t = trainer(
        tmp_path,
        [guard, bar_class()],
        max_steps=6,
        enable_progress_bar=True,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(FaultModel(site="loss", step=3), loader(FaultData()))
    assert guard.counters["incidents"] == 1 and guard.counters["rollbacks"] == 1  # control: the bar had entries
    about_logging = [
        str(w.message)
        for w in caught
        if not issubclass(w.category, NumGuardWarning)
        and ("self.log(" in str(w.message) or "numguard" in str(w.message))
    ]
    assert about_logging == []
