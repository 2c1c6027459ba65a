"""``NumGuardCallback`` state: round trip, pickling, resume from a checkpoint, ``last_finite.ckpt``."""

from __future__ import annotations

import copy
import logging
import pickle
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardError, NumGuardWarning
from tests.helpers import FaultData, FaultModel, all_finite, loader, trainer

INPUT_AT_3 = r"^NumGuard: non-finite value in `batch\['x'\]` at step 3 on rank 0"
ANY_NUMGUARD = r"^NumGuard: .+ at step 3 on rank 0"
pytestmark = [
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create"),
]
SETTINGS: dict[str, Any] = dict(
    action="rollback",
    # a persistent bad batch fails its retry and is quarantined at once
    recovery={"retry_transient": True, "replay": False},
    snapshot_every_n_steps=2,
    lr_backoff=0.5,
)


def _settings(cb: NumGuardCallback) -> dict[str, Any]:
    return cb.arguments()


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """6 steps under ``rollback``; batch 3 is NaN; ``last.ckpt`` saved after every step."""
    tmp = tmp_path_factory.mktemp("faulted")
    cb = NumGuardCallback(**SETTINGS)
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=1)
    tr = trainer(tmp, [cb, ckpt], max_steps=6, enable_checkpointing=True)
    with pytest.warns(NumGuardWarning, match=ANY_NUMGUARD) as records:
        tr.fit(FaultModel(site="input"), loader(FaultData(bad_batch=3, site="input")))
    warned = [str(r.message) for r in records if issubclass(r.category, NumGuardWarning)]
    assert re.match(INPUT_AT_3, warned[0]), warned  # the root cause is named first
    return SimpleNamespace(tmp=tmp, cb=cb, trainer=tr, last=tmp / "ckpt" / "last.ckpt")


def test_the_faulted_run_rolled_back_and_quarantined(faulted: SimpleNamespace) -> None:
    """Precondition of the tests below: there is non-trivial state to save."""
    cb = faulted.cb
    assert cb.counters["rollbacks"] == 1
    assert cb.counters["incidents"] >= 1
    assert [q["batch_idx"] for q in cb.quarantined] == [3]
    assert cb.events[0]["kind"] == "nonfinite_input"


# ----------------------------------------------------------------------------- round trip


def test_state_dict_round_trip_fresh() -> None:
    cb = NumGuardCallback(**SETTINGS)
    state = cb.state_dict()
    other = NumGuardCallback(**SETTINGS)
    other.load_state_dict(copy.deepcopy(state))
    assert other.state_dict() == state


def test_state_dict_round_trip_after_fit(faulted: SimpleNamespace) -> None:
    state = faulted.cb.state_dict()
    assert state["counters"]["rollbacks"] == 1
    other = NumGuardCallback(**SETTINGS)
    other.load_state_dict(copy.deepcopy(state))
    assert other.state_dict() == state
    again = NumGuardCallback(**SETTINGS)
    again.load_state_dict(other.state_dict())
    assert again.state_dict() == state


def test_load_state_dict_tolerates_missing_keys() -> None:
    cb = NumGuardCallback()
    cb.load_state_dict({})
    assert cb.state_dict() == NumGuardCallback().state_dict()


def test_checkpoint_holds_plain_types_only(faulted: SimpleNamespace) -> None:
    ckpt = torch.load(faulted.last, weights_only=True)  # rejects Enums, dataclasses, numpy objects
    assert ckpt["callbacks"][faulted.cb.state_key] == faulted.cb.state_dict()


# ----------------------------------------------------------------------------- pickling


def test_pickle_constructed_callback() -> None:
    cb = NumGuardCallback(**SETTINGS, dirpath="some/where")
    clone = pickle.loads(pickle.dumps(cb))
    assert _settings(clone) == _settings(cb)
    assert clone.state_dict() == cb.state_dict()


def test_pickle_after_fit(faulted: SimpleNamespace) -> None:
    """``ddp_spawn`` pickles the trainer with its callbacks at every ``fit``/``validate``/``test``."""
    clone = pickle.loads(pickle.dumps(faulted.cb))
    assert _settings(clone) == _settings(faulted.cb)
    assert clone.counters == faulted.cb.counters
    assert clone.quarantined == faulted.cb.quarantined
    assert clone.events == faulted.cb.events


# ----------------------------------------------------------------------------- resume


class _Probe(pl.Callback):
    """Copies the guard's state at ``on_fit_start`` (after Lightning loaded it) and watches the weights."""

    def __init__(self, guard: NumGuardCallback) -> None:
        self.guard = guard
        self.at_start: dict[str, Any] = {}
        self.unchanged: dict[tuple[int, int], bool] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_start = {
            "counters": dict(self.guard.counters),
            "quarantined": copy.deepcopy(self.guard.quarantined),
        }

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.unchanged[(trainer.current_epoch, batch_idx)] = all(
            torch.equal(a, b) for a, b in zip(self._before, pl_module.parameters())
        )


def test_resume_restores_counters_and_quarantine(faulted: SimpleNamespace, tmp_path: Path) -> None:
    cb = NumGuardCallback(**SETTINGS)
    probe = _Probe(cb)
    # epoch 1, batch 3 is global step 11; the data is clean now, the position is still quarantined
    tr = trainer(tmp_path, [cb, probe], max_steps=12, max_epochs=2)
    tr.fit(FaultModel(), loader(FaultData()), ckpt_path=faulted.last)
    assert probe.at_start["counters"] == faulted.cb.counters
    assert probe.at_start["quarantined"] == faulted.cb.quarantined
    assert tr.global_step == 12
    assert next(iter(probe.unchanged)) == (0, 6), "resumed after the checkpointed step"
    assert probe.unchanged[(1, 3)] is True, "the quarantined position was not trained on"
    assert not any(v for k, v in probe.unchanged.items() if k != (1, 3))
    assert cb.counters["skipped_steps"] == faulted.cb.counters["skipped_steps"] + 1
    assert cb.counters["incidents"] == faulted.cb.counters["incidents"]
    assert cb.counters["rollbacks"] == faulted.cb.counters["rollbacks"]
    assert cb.quarantined == faulted.cb.quarantined


def test_second_fit_without_checkpoint_starts_from_zero(faulted: SimpleNamespace, tmp_path: Path) -> None:
    cb = NumGuardCallback(**SETTINGS)
    cb.load_state_dict(faulted.cb.state_dict())
    tr = trainer(tmp_path, [cb], max_steps=2)
    tr.fit(FaultModel(), loader(FaultData()))
    assert cb.counters == {"incidents": 0, "skipped_steps": 0, "rollbacks": 0, "amp_overflow_steps": 0, "spikes": 0}
    assert cb.quarantined == []


# ----------------------------------------------------------------------------- last_finite.ckpt


def test_last_finite_ckpt_is_finite_and_plain(faulted: SimpleNamespace) -> None:
    path = faulted.cb.resolved_dirpath / "last_finite.ckpt"
    assert path.is_file()
    assert not path.with_name(path.name + ".tmp").exists(), "temporary file left behind"
    ckpt = torch.load(path, weights_only=True)
    assert all_finite(ckpt["state_dict"])
    assert all_finite(ckpt["optimizer_states"])
    assert ckpt["state_dict"], "no weights in the checkpoint"
    assert ckpt["global_step"] <= faulted.trainer.global_step


def test_last_finite_ckpt_loads_with_load_from_checkpoint(faulted: SimpleNamespace) -> None:
    path = faulted.cb.resolved_dirpath / "last_finite.ckpt"
    model = FaultModel.load_from_checkpoint(path, map_location="cpu")
    state = torch.load(path, weights_only=True)["state_dict"]
    assert all_finite(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_last_finite_ckpt_resumes_with_fit(faulted: SimpleNamespace, tmp_path: Path) -> None:
    path = faulted.cb.resolved_dirpath / "last_finite.ckpt"
    start = torch.load(path, weights_only=True)["global_step"]
    cb = NumGuardCallback(action="rollback", recovery={"replay": False})
    model = FaultModel()
    tr = trainer(tmp_path, [cb], max_steps=start + 2)
    tr.fit(model, loader(FaultData()), ckpt_path=path)
    assert tr.global_step == start + 2
    assert all_finite(model.state_dict())
    assert cb.counters["rollbacks"] == faulted.cb.counters["rollbacks"], "callback state came along"


# ----------------------------------------------------------------------------- the events of the run resumed from


def test_a_resumed_runs_summary_points_at_the_events_of_the_run_it_resumed_from(
    faulted: SimpleNamespace, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: "1 incident in 8 steps ... no events written", with no word of where that incident is told."""
    first = faulted.cb.resolved_dirpath / "events.jsonl"
    assert first.exists() and faulted.cb.state_dict()["events_files"] == [str(first)]
    guard = NumGuardCallback(**SETTINGS, dirpath=str(tmp_path / "ng"))
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        trainer(tmp_path, [guard], max_steps=8).fit(
            FaultModel(site="input"), loader(FaultData(bad_batch=3, site="input")), ckpt_path=str(faulted.last)
        )
    assert guard.events == [] and guard.counters["incidents"] == faulted.cb.counters["incidents"]
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NumGuard: ")]
    incidents = guard.counters["incidents"]
    before = "(before the resume)" if incidents == 1 else "(all before the resume)"
    assert summary.startswith(f"NumGuard: {incidents} incident{'s' if incidents > 1 else ''} {before} in 8 steps")
    assert summary.splitlines()[-2:] == [
        "  no events written in this run",
        f"  events of the run this one resumed from: {first}",
    ], summary
    # the chain goes on: a run resumed from this one's checkpoints knows both files
    assert guard.state_dict()["events_files"] == [str(first), str(tmp_path / "ng" / "events.jsonl")]


def test_events_files_that_are_no_list_of_paths_are_malformed() -> None:
    with pytest.raises(NumGuardError, match="malformed at 'events_files'"):
        NumGuardCallback().load_state_dict({"events_files": "a/events.jsonl"})
