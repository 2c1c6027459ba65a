"""Issue 10: one log line per action taken, fileless runs, and warnings that point at the user's line."""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NonFiniteError, NumGuardWarning
from lightning_numguard.reporting.explain import explain
from tests.helpers import EVERY_CHECK, FaultData, FaultModel, loader, quiet_trainer, trainer

LEDGER = "lightning_numguard"  # the action lines go to the package logger, where users look


def _fit_quietly(
    tmp_path: Any, cb: NumGuardCallback, site: str, step: int = 3, model: type[FaultModel] = FaultModel, **kwargs: Any
) -> Any:
    kwargs.setdefault("max_steps", 6)
    tr = trainer(tmp_path, [cb], **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(NonFiniteError):
            tr.fit(model(site=site, step=step), loader(FaultData()))
    return tr


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LEDGER]


def test_rollback_logs_one_warning_naming_the_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = NumGuardCallback(
        action="rollback", check=EVERY_CHECK, dirpath=str(tmp_path / "ng"), recovery={"replay": False}
    )
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        _fit_quietly(tmp_path, cb, "loss")
    ((level, text),) = _lines(caplog)
    assert level == logging.WARNING
    # the snapshot is the state at the start of step 3 (issue 20: not "from step 3 ... 0 steps lost")
    assert text.startswith("NumGuard rolled back at step 3 because of nonfinite_loss in loss: ")
    assert "back to the verified-finite state at the start of this step, so only this batch's update is dropped" in text
    assert f"last finite checkpoint: {tmp_path / 'ng' / 'last_finite.ckpt'}" in text
    assert f"events: {tmp_path / 'ng' / 'events.jsonl'}" in text
    assert (tmp_path / "ng" / "last_finite.ckpt").exists() and (tmp_path / "ng" / "events.jsonl").exists()


def test_halt_logs_one_error_saying_halted_why_and_where(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = NumGuardCallback(action="halt", check=EVERY_CHECK, dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        tr = _fit_quietly(tmp_path, cb, "loss")
    ((level, text),) = _lines(caplog)
    assert level == logging.ERROR
    assert text.startswith("NumGuard halted training at step 3")
    assert "because of nonfinite_loss in loss" in text
    assert f"last finite checkpoint: {tmp_path / 'ng' / 'last_finite.ckpt'}" in text
    assert tr.should_stop and tr.global_step < 6


def test_escalation_skip_to_rollback_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = NumGuardCallback(action="skip", check=EVERY_CHECK, dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        _fit_quietly(tmp_path, cb, "param")
    ((level, text),) = _lines(caplog)
    assert level == logging.WARNING and text.startswith("NumGuard rolled back at step 3")
    assert "escalated from 'skip' to 'rollback': the weights or optimizer state were no longer finite" in text


def test_escalation_rollback_to_halt_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = NumGuardCallback(
        action="rollback", max_rollbacks=0, check=EVERY_CHECK, dirpath=str(tmp_path), recovery={"replay": False}
    )
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        _fit_quietly(tmp_path, cb, "loss")
    ((level, text),) = _lines(caplog)
    assert level == logging.ERROR and text.startswith("NumGuard halted training at step 3")
    assert "escalated from 'rollback' to 'halt': max_rollbacks reached (0 rollbacks in this fit)" in text


@pytest.mark.parametrize("dirpath", [None, "ng"])
def test_fast_dev_run_writes_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dirpath: str | None) -> None:
    monkeypatch.chdir(tmp_path)
    cb = NumGuardCallback(action="rollback", check=EVERY_CHECK, dirpath=dirpath, recovery={"replay": False})
    _fit_quietly(tmp_path / "root", cb, "loss", step=1, fast_dev_run=3, max_steps=-1)
    assert [(e["kind"], e["step"]) for e in cb.events] == [("nonfinite_loss", 1)]
    assert cb.counters["rollbacks"] == 1
    written = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert not {"events.jsonl", "last_finite.ckpt"} & set(written), written


def test_a_halt_with_no_logger_no_checkpointing_no_dirpath_still_writes_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A halted run's last finite state must outlive the process: with nowhere chosen it goes into
    ``<default_root_dir>/numguard`` (here the working directory's), and the message says where."""
    monkeypatch.chdir(tmp_path)
    cb = NumGuardCallback(action="halt", check=EVERY_CHECK, recovery={"replay": False})
    tr = quiet_trainer([cb], max_steps=6)  # no default_root_dir: the working directory
    with warnings.catch_warnings(), pytest.raises(NonFiniteError) as err:
        warnings.simplefilter("ignore")
        tr.fit(FaultModel(site="loss", step=3), loader(FaultData()))
    assert [(e["kind"], e["action"]) for e in cb.events] == [("nonfinite_loss", "halt")]
    assert sorted(p.name for p in (tmp_path / "numguard").iterdir()) == ["events.jsonl", "last_finite.ckpt"]
    assert str(tmp_path / "numguard" / "last_finite.ckpt") in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["numguard"]


def test_warnings_point_at_the_users_line(tmp_path: Path) -> None:
    cb = NumGuardCallback(action="skip", check=EVERY_CHECK, dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    tr = trainer(tmp_path, [cb], max_steps=6)
    with pytest.warns(NumGuardWarning) as records:
        tr.fit(FaultModel(site="loss", step=3), loader(FaultData()))
    ours = [w for w in records if issubclass(w.category, NumGuardWarning)]
    assert ours and all(Path(w.filename).name == Path(__file__).name for w in ours), [w.filename for w in ours]


def test_explain_counts_incidents_like_the_counter(tmp_path: Path) -> None:
    """One NaN batch: several events (the input and its consequences), one incident, in the counter and explain."""
    cb = NumGuardCallback(action="rollback", check=EVERY_CHECK, dirpath=str(tmp_path / "ng"))
    tr = trainer(tmp_path, [cb], max_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr.fit(FaultModel(), loader(FaultData(bad_batch=3, site="input")))
    assert len(cb.events) > 1 and cb.events[0]["kind"] == "nonfinite_input"
    summary = explain(tmp_path / "ng" / "events.jsonl").summary
    assert summary["incidents"] == cb.counters["incidents"] == 1
    assert summary["events"] == len(cb.events)


def test_a_rollback_says_what_it_restored_and_what_was_lost(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 20: with snapshot_every_n_steps=50, the words match what happened, both ways a rollback can go."""
    for site, restored, lost in (
        ("loss", "back to the verified-finite state at the start of this step", "only this batch's update is dropped"),
        ("param", "back to the verified-finite snapshot of step 0", "the updates of steps 0-2 (3 steps) are lost"),
    ):
        caplog.clear()
        cb = NumGuardCallback(action="rollback", snapshot_every_n_steps=50, dirpath=str(tmp_path / site))
        with caplog.at_level(logging.INFO, logger="lightning_numguard"):
            _fit_quietly(tmp_path, cb, site)
        ((_, text),) = _lines(caplog)
        assert text.startswith("NumGuard rolled back at step 3 ") and restored in text and lost in text, text
        assert "restored the last finite state" not in text
        summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NumGuard: ")]
        ending = "(to the start of its bad step: no earlier step lost)." if site == "loss" else "(3 steps lost)."
        assert ending in summary[0], summary


class RepeatingLoss(FaultModel):
    """The loss goes NaN at every step from ``step`` on (``step`` to ``step + 2`` with ``until_end=False``)."""

    until_end = True

    def _armed(self) -> bool:
        last = None if self.until_end else self.fault_step + 2
        return (
            self.site is not None and self.fault_step <= self.global_step and (last is None or self.global_step <= last)
        )


class ThreeBadSteps(RepeatingLoss):
    until_end = False


def test_rollbacks_for_the_same_cause_are_one_line_then_the_halt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: one ~400-character line per rolled-back step (ten of them before the halt of max_rollbacks=10)."""
    cb = NumGuardCallback(action="rollback", max_rollbacks=3, dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        _fit_quietly(tmp_path, cb, "loss", model=RepeatingLoss, max_steps=10)
    shown = [(level, text) for level, text in _lines(caplog) if level >= logging.WARNING]
    assert [level for level, _ in shown] == [logging.WARNING, logging.WARNING, logging.ERROR], shown
    first, again, halt = (text for _, text in shown)
    assert first.startswith("NumGuard rolled back at step 3 because of nonfinite_loss in loss: ")
    assert again == "NumGuard rolled back again at steps 4, 5 (2 times, same cause: nonfinite_loss in loss)."
    assert halt.startswith("NumGuard halted training at step 6 because of nonfinite_loss in loss")
    assert "max_rollbacks reached (3 rollbacks in this fit)" in halt
    # each repeat keeps its own full line at INFO, for log files
    infos = [text for level, text in _lines(caplog) if level == logging.INFO and text.startswith("NumGuard rolled")]
    assert [t.split(" because")[0] for t in infos] == [
        "NumGuard rolled back at step 4",
        "NumGuard rolled back at step 5",
    ]


def test_repeats_are_said_at_the_fit_end_before_the_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = NumGuardCallback(action="skip", dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    with caplog.at_level(logging.WARNING, logger="lightning_numguard"):
        _fit_quietly(tmp_path, cb, "loss", model=ThreeBadSteps, max_steps=8)
    texts = [r.getMessage() for r in caplog.records if r.name.startswith(LEDGER)]
    assert texts[0].startswith("NumGuard skipped the optimizer step at step 3 because of nonfinite_loss in loss;")
    assert texts[1] == "NumGuard skipped again at steps 4, 5 (2 times, same cause: nonfinite_loss in loss)."
    assert texts[2].startswith("NumGuard: 3 incidents in 8 steps, handled by 3 skipped steps."), texts
    assert len(texts) == 3, texts


def test_the_repeat_line_names_its_steps() -> None:
    from lightning_numguard.reporting.messages import repeat_message, steps_words

    root = {"kind": "nonfinite_output", "where": ["dec.net.0"], "op": "exp", "source": "/a/b/vae.py:26"}
    assert repeat_message("rollback", [7, 9, 11], root) == (
        "NumGuard rolled back again at steps 7, 9, 11 (3 times, same cause: nonfinite_output in dec.net.0)."
    )
    assert (
        repeat_message("skip", [4], root)
        == "NumGuard skipped again at step 4 (same cause: nonfinite_output in dec.net.0)."
    )
    assert steps_words([5, 6, 7, 8, 12, 13, 20]) == "5-8, 12, 13, 20"
    assert steps_words(list(range(0, 40, 2)), limit=3) == "0, 2, 4 and 17 more"


def test_the_warm_up_warning_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the same sentence as a WARNING log line and as a warning, after a line saying detection arms."""
    from lightning_utilities.core import rank_zero

    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), spike_action="skip", spikes={"warmup": 20})
    lightning, level = rank_zero.log, rank_zero.log.level  # where the fit-start line goes (the suite quiets it)
    lightning.addHandler(caplog.handler)
    lightning.setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.INFO), pytest.warns(NumGuardWarning, match="cannot act") as records:
            trainer(tmp_path, [guard], max_steps=10).fit(FaultModel(), loader(FaultData()))
    finally:
        lightning.removeHandler(caplog.handler)
        lightning.setLevel(level)
    assert sum("cannot act" in str(r.message) for r in records) == 1
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "spike" in r.getMessage()]
    assert loud == []
    assert not any("arms after" in r.getMessage() for r in caplog.records)  # it does not arm in this fit
