"""An input incident names the sample and the position in the batch (issue 35): ``batch['x'][3, 7]``, which
sample of the batch and its dataset index, computed after the hit only (a clean step keeps its one host read)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from instruments.syncs import SyncCounter
from lightning_numguard import NumGuardCallback
from lightning_numguard.reporting.explain import explain
from tests.helpers import FaultData, FaultModel, SyncWindow, loader, trainer


class OneBadValue(FaultData):
    """Sample 27 (row 3 of batch 3) holds a NaN at column 7, sample 29 an Inf at column 2."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = super().__getitem__(i)
        if self.idx[i] == 27:
            item["x"][7] = float("nan")
        if self.idx[i] == 29:
            item["x"][2] = float("inf")
        return item


def _fit(tmp_path: Path, data: FaultData, *extra: Any) -> NumGuardCallback:
    guard = NumGuardCallback(action="skip", dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path, [*extra, guard], max_steps=6).fit(FaultModel(), loader(data))
    return guard


def test_a_nan_in_the_batch_is_named_by_sample_and_position(tmp_path: Path) -> None:
    counter = SyncCounter(package="lightning_numguard")
    with counter:
        guard = _fit(tmp_path, OneBadValue(), SyncWindow(counter))
    first = guard.events[0]
    assert (first["kind"], first["step"], first["where"]) == ("nonfinite_input", 3, ["batch['x']"])
    details = first["details"]
    assert details["positions"] == [[3, 7], [5, 2]] and details["samples"] == [3, 5]
    assert (details["bad_samples"], details["samples_in_batch"], details["sample_indices"]) == (2, 8, [27, 29])
    assert (
        "first at batch['x'][3, 7], batch['x'][5, 2] (samples 3, 5 of 8 in the batch; dataset indices 27, 29)"
        in first["message"]
    ), first["message"]
    # the file says it too, and explain shows it
    assert "batch['x'][3, 7]" in explain(tmp_path / "ng").text
    # the positions cost no host read on the clean steps: one read each, as before
    clean = [n for step, n in enumerate(counter.step_caused) if step != 3]
    assert clean == [1] * 5, counter.step_caused


def test_a_fill_value_is_named_by_sample_and_position(tmp_path: Path) -> None:
    guard = _fit(tmp_path, FaultData(bad_batch=3, site="masked"))  # every sample of batch 3: x[0] = 1e20
    first = guard.events[0]
    assert (first["kind"], first["where"]) == ("suspicious_input", ["batch['x']"])
    assert first["details"]["positions"] == [[0, 0], [1, 0], [2, 0]]
    assert first["details"]["sample_indices"] == [24, 25, 26]
    assert (
        "first at batch['x'][0, 0], batch['x'][1, 0], batch['x'][2, 0] (samples 0, 1, 2 and 5 more of 8 in "
        in (first["message"])
    )
    assert "dataset indices 24, 25, 26)" in first["message"]
