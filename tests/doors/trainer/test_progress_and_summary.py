"""Counts in Lightning's progress bars (TQDM and Rich) once something happened, and the end-of-fit summary."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import rich
from pytorch_lightning.callbacks import Callback, RichProgressBar, TQDMProgressBar
from rich.console import Console

from instruments.syncs import SyncCounter
from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from lightning_numguard.reporting.summary import rich_table, summarize, summary_text
from tests.helpers import FaultData, FaultModel, SyncWindow, loader, trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:The number of training batches .* logging interval", "ignore::lightning_numguard.errors.NumGuardWarning"
)
#: The progress-bar keys: short, as Rich crops a key wider than its metrics column (the loggers keep numguard/...).
BAR_KEYS = ("nan_incidents", "rollbacks")
COUNTER_TAGS = ("numguard/incidents", "numguard/rollbacks")


class BarSpy(Callback):
    """The guard's progress-bar entries as the bar sees them at the start of every batch."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        bar_metrics = trainer.progress_bar_callback.get_metrics(trainer, pl_module)
        self.seen.append({k: v for k, v in bar_metrics.items() if k in BAR_KEYS or k.startswith("numguard/")})


def _fit(
    tmp_path: Path,
    bar: Callback | None,
    site: str | None = "loss",
    action: str = "rollback",
    trainer_kw: dict[str, Any] | None = None,
    dirpath_override: str | None = None,
    **kw: Any,
) -> Any:
    guard = NumGuardCallback(action=action, dirpath=dirpath_override or str(tmp_path / "ng"), **kw)
    spy = BarSpy()
    callbacks: list[Callback] = [guard] + ([bar, spy] if bar is not None else [])
    t = trainer(tmp_path, callbacks, max_steps=6, enable_progress_bar=bar is not None, **(trainer_kw or {}))
    t.fit(FaultModel(site=site, step=3), loader(FaultData()))
    return guard, spy, t


@pytest.mark.parametrize("bar_class", [TQDMProgressBar, RichProgressBar])
def test_counts_appear_in_the_bar_only_once_something_happened(tmp_path: Path, bar_class: type) -> None:
    guard, spy, t = _fit(tmp_path, bar_class())
    assert guard.counters["incidents"] == 1 and guard.counters["rollbacks"] == 1
    # batches 0-3 start before the step-3 incident was logged; from batch 4 on the bar shows it
    assert spy.seen[:4] == [{}, {}, {}, {}]
    assert all(s == {"nan_incidents": 1, "rollbacks": 1} for s in spy.seen[4:]), spy.seen
    # integers, which both bars show as "1" (a float is shown "1.000" by Rich, issue 27)
    assert all(type(v) is int for s in spy.seen[4:] for v in s.values()), spy.seen
    assert {k: t.progress_bar_metrics[k] for k in BAR_KEYS} == {"nan_incidents": 1, "rollbacks": 1}
    # logger=False: the loggers get the counters as numguard/... scalars from the reporter
    assert not (set(BAR_KEYS) | set(COUNTER_TAGS)) & set(t.logged_metrics)


def test_a_clean_run_shows_nothing_in_the_bar(tmp_path: Path) -> None:
    guard, spy, t = _fit(tmp_path, TQDMProgressBar(), site=None)
    assert guard.events == [] and spy.seen == [{}] * 6
    assert not (set(BAR_KEYS) | set(COUNTER_TAGS)) & set(t.progress_bar_metrics)


def test_the_bar_entries_cost_no_extra_host_read(tmp_path: Path) -> None:
    """Still one host read per step caused by the guard, steps after an incident included."""
    counter = SyncCounter(package="lightning_numguard")

    guard = NumGuardCallback(action="skip", dirpath=str(tmp_path / "ng"), recovery={"replay": False})
    t = trainer(tmp_path, [SyncWindow(counter), guard, TQDMProgressBar()], max_steps=8, enable_progress_bar=True)
    t.callbacks = [c for c in t.callbacks if c is not guard] + [guard]  # the guard's batch end inside the window
    with counter:
        t.fit(FaultModel(site="loss", step=2), loader(FaultData()))
    assert guard.counters["incidents"] == 1 and t.progress_bar_metrics["nan_incidents"] == 1
    steps_after = counter.step_caused[3:]
    assert len(counter.step_caused) == 8 and steps_after == [1] * 5, counter.step_caused


# ----------------------------------------------------------------------------- summary


def test_summary_logged_as_a_warning_after_incidents(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A weight poisoned before step 3: the rollback goes back to the snapshot of step 2, losing step 2's update."""
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        guard, _, _ = _fit(tmp_path, None, site="param", snapshot_every_n_steps=2)
    assert [(e["kind"], e["step"], e["action"]) for e in guard.events][:1] == [("nonfinite_param", 3, "rollback")]
    (record,) = [r for r in caplog.records if r.getMessage().startswith("NumGuard: ")]
    assert record.levelno == logging.WARNING and record.name.startswith("lightning_numguard")
    text = record.getMessage()
    # one incident, handled by one action: a rollback drops its step's update, it is not a skip besides
    assert text.splitlines()[0] == "NumGuard: 1 incident in 6 steps, handled by 1 rollback (1 step lost)."
    # one root cause (incidents count root causes); its consequences are counted apart, by kind
    assert text.splitlines()[1:3] == [
        "  nonfinite_param in body.0.weight  x1   step 3",
        "  consequences (the same incidents, not counted): nonfinite_output x1, nonfinite_loss x1, nonfinite_grad x1, "
        "nonfinite_param x1",
    ]
    assert f"events: {tmp_path / 'ng' / 'events.jsonl'}" in text


def test_summary_of_a_clean_run_is_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        _fit(tmp_path, None, site=None)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("NumGuard: ")]
    assert record.levelno == logging.INFO
    assert record.getMessage() == "NumGuard: no incidents in 6 steps. no events written in this run"


def test_summary_when_halt_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_numguard"), pytest.raises(Exception, match="halted"):
        _fit(tmp_path, None, action="halt", trainer_kw={"min_steps": 6})
    (record,) = [r for r in caplog.records if r.getMessage().startswith("NumGuard: ")]
    assert record.getMessage().startswith("NumGuard: 1 incident in 4 steps (the fit ended with NonFiniteError)")


def test_summary_table_under_the_rich_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fit(tmp_path, RichProgressBar())
    out = capsys.readouterr().out
    assert "NumGuard" in out and "nonfinite_loss in loss" in out and "root cause" in out


# ----------------------------------------------------------------------------- the pure summary


def _event(kind: str, step: int, where: list[str]) -> dict[str, Any]:
    return {"kind": kind, "step": step, "where": where}


SUMMARY_TABLE = [
    (
        [],
        {},
        0,
        "NumGuard: no incidents in 10 steps. events: /r/events.jsonl",
    ),
    (
        [],
        {"amp_overflow_steps": 2},
        0,
        "NumGuard: no incidents in 10 steps; 2 AMP overflow steps (the GradScaler's, not incidents). "
        "events: /r/events.jsonl",
    ),
    (
        [_event("nonfinite_input", 3, ["batch['x']"]), _event("nonfinite_loss", 3, ["loss"])],
        {"incidents": 2, "skipped_steps": 1},
        0,
        "NumGuard: 2 incidents in 10 steps, handled by 1 skipped step.\n"
        "  nonfinite_input in batch['x']  x1   step 3\n"
        "  nonfinite_loss in loss         x1   step 3\n"
        "  events: /r/events.jsonl",
    ),
    (
        [
            _event("nonfinite_output", 4, ["body.1"]),
            _event("optimizer_coverage", 0, []),
            _event("nonfinite_output", 7, ["x"]),
        ],
        {"incidents": 2, "skipped_steps": 2, "rollbacks": 2},
        5,
        "NumGuard: 2 incidents in 10 steps, handled by 2 rollbacks (5 steps lost).\n"
        "  nonfinite_output in body.1  x1   step 4\n"
        "  optimizer_coverage          x1   step 0  (a warning, not an incident)\n"
        "  nonfinite_output in x       x1   step 7\n"
        "  events: /r/events.jsonl",
    ),
]


@pytest.mark.parametrize(("events", "counters", "lost", "expected"), SUMMARY_TABLE)
def test_summary_text_table(events: list[dict[str, Any]], counters: dict[str, int], lost: int, expected: str) -> None:
    assert summary_text(summarize(events, counters, lost, 10, "/r/events.jsonl")) == expected


def test_summary_kinds_in_order_of_first_appearance() -> None:
    s = summarize([_event("b", 5, ["q"]), _event("a", 6, []), _event("b", 9, ["z"])], {"incidents": 3}, 0, 9, None)
    assert [(k.kind, k.count, k.first_step, k.first_culprit) for k in s.kinds] == [("b", 2, 5, "q"), ("a", 1, 6, "")]
    assert s.eventful and summary_text(s).endswith("  no events written in this run")


def test_rich_table_renders_every_kind() -> None:
    s = summarize([_event("nonfinite_grad", 2, ["head.weight"])], {"incidents": 1, "rollbacks": 1}, 1, 8, "/r/e.jsonl")
    console = Console(record=True, width=100)
    console.print(rich_table(s))
    text = console.export_text()
    assert "nonfinite_grad in head.weight" in text and "1 rollback (1 step lost)" in text


def test_warnings_are_unchanged_by_the_summary(tmp_path: Path) -> None:
    """The summary is a log record, not a warning: the incident warnings stay one per kind and place."""
    guard = NumGuardCallback(action="rollback", dirpath=str(tmp_path / "ng"))
    t = trainer(tmp_path, [guard], max_steps=6)
    with pytest.warns(NumGuardWarning) as records:
        t.fit(FaultModel(site="loss", step=3), loader(FaultData()))
    assert len([r for r in records if issubclass(r.category, NumGuardWarning)]) == 1


# ----------------------------------------------------------------------------- under a Rich bar, as a terminal shows it

_ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


@pytest.fixture
def rich_terminal() -> Any:
    """An 80-column terminal for Rich (the bar reconfigures Rich's global console); the default console after."""
    yield {"force_terminal": True, "width": 80, "color_system": None}
    rich.reconfigure()


def _frames(out: str) -> list[str]:
    """The frames a live Rich display drew into ``out`` (each redraw starts with a carriage return), ANSI codes gone."""
    return _ANSI.sub("", out).split("\r")


def test_the_bar_entries_are_not_cut_in_an_80_column_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rich_terminal: dict[str, Any]
) -> None:
    _fit(tmp_path, RichProgressBar(console_kwargs=rich_terminal))
    frames = [f for f in _frames(capsys.readouterr().out) if f.lstrip().startswith("Epoch 0")]
    assert frames  # control: the bar was drawn
    last = frames[-1]
    assert "…" not in last, last
    for key in BAR_KEYS:
        assert f"{key}:" in last, (key, last)


def test_the_summary_is_shown_once_under_the_rich_bar_with_its_path_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The table is the summary under a Rich bar: the text goes to the log at INFO (not shown by default), and the
    path to ``events.jsonl`` is printed on a line of its own, never folded mid-word by the table's width."""
    deep = tmp_path / "a_rather_long_folder_name" / "another_long_folder_name" / "numguard_events"
    with caplog.at_level(logging.INFO, logger="lightning_numguard"):
        guard, _, _ = _fit(tmp_path, RichProgressBar(), dirpath_override=str(deep))
    out = capsys.readouterr().out
    assert out.count("root cause") == 1  # the table, once
    summaries = [r for r in caplog.records if r.getMessage().startswith("NumGuard: ")]
    assert [r.levelno for r in summaries] == [logging.INFO]  # the text is not shown a second time by default
    path = str(guard.resolved_dirpath / "events.jsonl")
    assert len(path) > 80  # control: wider than the console
    assert path in out.splitlines() or f"events: {path}" in out.splitlines(), out


def test_the_summary_names_a_kind_by_its_first_root_cause_not_a_consequence():
    """A checkpoint swap is a consequence of the poisoned weight the next read names: the summary's first culprit of
    ``nonfinite_param`` is that weight, not ``checkpoint``."""
    from lightning_numguard.reporting.summary import summarize, summary_text

    events = [
        {"kind": "nonfinite_param", "step": 4, "where": ["checkpoint"], "root_cause": False},
        {"kind": "nonfinite_param", "step": 5, "where": ["fc.weight"], "root_cause": True},
        {"kind": "nonfinite_loss", "step": 5, "where": ["loss"], "root_cause": False},
    ]
    s = summarize(events, {"incidents": 1}, 0, 6, None)
    param, loss = s.kinds
    assert (param.count, param.first_step, param.first_culprit) == (2, 5, "fc.weight")
    assert (loss.first_step, loss.first_culprit) == (5, "loss")  # only consequences: the first of them
    text = summary_text(s)
    assert "  nonfinite_param in fc.weight  x1   step 5\n" in text and "checkpoint" not in text
    assert "consequences (the same incidents, not counted): nonfinite_param x1, nonfinite_loss x1" in text


def test_the_summary_of_a_resumed_run_says_which_incidents_came_before_and_where_they_are() -> None:
    events = [{"kind": "nonfinite_loss", "step": 12, "where": ["loss"], "action": "skip"}]
    s = summarize(
        events, {"incidents": 3, "skipped_steps": 3}, 0, 20, "/b/events.jsonl", resumed_from="/a/events.jsonl"
    )
    lines = summary_text(s).splitlines()
    assert lines[0] == "NumGuard: 3 incidents (2 of them before the resume) in 20 steps, handled by 3 skipped steps."
    assert lines[-2:] == ["  events: /b/events.jsonl", "  events of the run this one resumed from: /a/events.jsonl"]
    moved = summarize(
        [], {"incidents": 1, "skipped_steps": 1}, 0, 20, None, resumed_from="/a/e.jsonl", resumed_found=False
    )
    assert summary_text(moved).splitlines() == [
        "NumGuard: 1 incident (before the resume) in 20 steps, handled by 1 skipped step.",
        "  no events written in this run",
        "  events of the run this one resumed from: /a/e.jsonl (not found here)",
    ]
