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
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"), recovery={"replay": False})
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


def test_a_nan_batch_warns_once_its_consequences_are_recorded_not_warned(tmp_path: Path) -> None:
    """One warning per root cause: the module outputs, loss, gradients and buffers that the NaN batch made
    non-finite are events (file, loggers, summary), not four more warnings saying "fix that first"."""
    guard = NumGuardCallback(action="skip", dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [guard], max_steps=5).fit(FaultModel(), loader(FaultData(bad_batch=3, site="input")))
    consequences = [e for e in guard.events if not e["root_cause"]]
    assert consequences, "control: the NaN batch had consequences"
    warned = [str(w.message) for w in caught if issubclass(w.category, NumGuardWarning)]
    assert len(warned) == 1, warned
    assert warned[0].startswith("NumGuard: non-finite value in `batch['x']` at step 3 on rank 0"), warned[0]
