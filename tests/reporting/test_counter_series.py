"""The counters as a TensorBoard series on Lightning's own logging steps, read back from real event files.

Lightning writes its metrics when ``(step + 1) % log_every_n_steps == 0`` (steps 2, 5 for 3); the guard's
points are on the same steps and step numbers, in a ``log_metrics`` call of their own, so they line up with the
loss curve. A clean run shows that the guard is on (a flat line at 0); an incident run shows each counter that moved rising
at the step it happened, as well as on the series' steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import STORE_EVERYTHING_SIZE_GUIDANCE, EventAccumulator

from instruments.syncs import SyncCounter
from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import FaultData, FaultModel, SyncWindow, loader, trainer

SERIES_TAGS = ("numguard/incidents", "numguard/skipped_steps", "numguard/rollbacks")
EVERY = 3
STEPS = 8  # Lightning writes at steps 2 and 5


class LossModel(FaultModel):
    """``FaultModel`` that logs its loss, as a user would: the steps Lightning writes its metrics at."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss.detach())
        return loss


def _series(log_dir: str, names: tuple[str, ...] = SERIES_TAGS) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(log_dir, size_guidance=STORE_EVERYTHING_SIZE_GUIDANCE)
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in names if tag in tags}


def _fit(tmp_path: Path, site: str | None, **kw: Any) -> tuple[NumGuardCallback, TensorBoardLogger]:
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    logger = TensorBoardLogger(tmp_path, name="tb")
    t = trainer(tmp_path, [guard], max_steps=STEPS, logger=logger, log_every_n_steps=EVERY, **kw)
    t.fit(LossModel(site=site, step=4), loader(FaultData()))
    return guard, logger


def test_a_clean_run_shows_the_counters_at_zero_on_the_steps_lightning_logs_the_loss(tmp_path: Path) -> None:
    guard, logger = _fit(tmp_path, None)
    assert guard.events == []
    series = _series(logger.log_dir, (*SERIES_TAGS, "train_loss", "numguard/grad_norm"))
    loss_steps = [step for step, _ in series.pop("train_loss")]
    assert loss_steps == [2, 5]
    assert [step for step, _ in series.pop("numguard/grad_norm")] == loss_steps
    assert series == {tag: [(2, 0.0), (5, 0.0)] for tag in SERIES_TAGS}


def test_an_incident_run_shows_each_counter_rising_at_its_step(tmp_path: Path) -> None:
    with pytest.warns(NumGuardWarning, match=r"the loss is non-finite at step 4 on rank 0"):
        guard, logger = _fit(tmp_path, "loss")
    assert guard.counters["incidents"] == guard.counters["rollbacks"] == guard.counters["skipped_steps"] == 1
    series = _series(logger.log_dir)
    # Lightning's steps, and the incident's step itself (counters reach the loggers when it happens)
    assert series == {tag: [(2, 0.0), (4, 1.0), (5, 1.0)] for tag in SERIES_TAGS}


def test_an_incident_on_a_series_step_is_written_once(tmp_path: Path) -> None:
    """The incident's write and the series' write of the same step are one point per tag, not two."""
    guard = NumGuardCallback(action="skip", dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    logger = TensorBoardLogger(tmp_path, name="tb")
    t = trainer(tmp_path, [guard], max_steps=STEPS, logger=logger, log_every_n_steps=EVERY)
    with pytest.warns(NumGuardWarning, match=r"the loss is non-finite at step 5 on rank 0"):
        t.fit(FaultModel(site="loss", step=5), loader(FaultData()))
    series = _series(logger.log_dir)
    assert series["numguard/skipped_steps"] == [(2, 0.0), (5, 1.0)]
    # a counter that did not move is not written at the incident's step: not a copy of the others' curve
    assert series["numguard/rollbacks"] == [(2, 0.0), (5, 0.0)]


def test_other_loggers_get_the_series_too(tmp_path: Path) -> None:
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    logger = CSVLogger(tmp_path, name="csv")
    trainer(tmp_path, [guard], max_steps=STEPS, logger=logger, log_every_n_steps=EVERY).fit(
        FaultModel(), loader(FaultData())
    )
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    steps = [int(r.split(",")[header.index("step")]) for r in rows[1:]]
    assert steps == [2, 5]
    assert all(tag in header for tag in SERIES_TAGS)


def test_the_series_costs_no_host_read(tmp_path: Path) -> None:
    """Still exactly one host read per step caused by the guard, series steps included (counters are host ints)."""
    counter = SyncCounter(package="lightning_numguard")
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    t = trainer(
        tmp_path, [SyncWindow(counter), guard], max_steps=6, logger=TensorBoardLogger(tmp_path), log_every_n_steps=1
    )
    with counter:
        t.fit(FaultModel(), loader(FaultData()))
    assert counter.step_caused == [1] * 6, counter.step_caused


def test_amp_overflow_steps_is_not_logged_without_a_grad_scaler(tmp_path: Path) -> None:
    """bf16-mixed has no GradScaler: nothing overflows on its account, so its counter is no curve (issue 27)."""
    with pytest.warns(NumGuardWarning, match=r"the loss is non-finite at step 4 on rank 0"):
        guard, logger = _fit(tmp_path, "loss", precision="bf16-mixed")
    assert guard.counters["incidents"] == 1
    tags = set(_series(logger.log_dir, ("numguard/incidents", "numguard/amp_overflow_steps")))
    assert tags == {"numguard/incidents"}
