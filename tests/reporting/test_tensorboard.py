"""Incident reports read back from real loggers: TensorBoard files, CSV, ``events.jsonl``, warnings."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import (
    STORE_EVERYTHING_SIZE_GUIDANCE,
    EventAccumulator,
)
from tensorboard.util import tensor_util

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardWarning
from lightning_numguard.reporting.events import ACTIONS, KINDS, REQUIRED_FIELDS, read_events
from tests.helpers import EVERY_CHECK, FaultData, FaultModel, loader, trainer

pytestmark = pytest.mark.filterwarnings("ignore:The number of training batches .* logging interval")

FAULT_STEPS = (3, 6)
COUNTER_TAGS = ("numguard/incidents", "numguard/skipped_steps", "numguard/rollbacks")
OUTPUT_AT_3 = r"module `body\.1` produced the first non-finite output at step 3 on rank 0"
LOSS_AT_2 = r"the loss is non-finite at step 2 on rank 0"
LOSS_AT_3 = r"the loss is non-finite at step 3 on rank 0"
ANY_NUMGUARD = r"^NumGuard: .+ at step \d+ on rank 0"


class MultiFaultModel(FaultModel):
    """``FaultModel`` whose fault fires at every global step in ``steps`` (not only one)."""

    def __init__(self, site: str, steps: tuple[int, ...]) -> None:
        super().__init__(site=site, step=steps[0])
        self.fault_steps = tuple(steps)

    def _armed(self) -> bool:
        return self.site is not None and self.global_step in self.fault_steps


def _fit(tmp_path: Path, cb: NumGuardCallback, site: str, steps: tuple[int, ...], **kwargs: Any) -> Any:
    kwargs.setdefault("max_steps", 8)
    tr = trainer(tmp_path, [cb], **kwargs)
    tr.fit(MultiFaultModel(site, steps), loader(FaultData()))
    return tr


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    events, problems = read_events(path)
    assert problems == [], problems
    return events


def _tb(log_dir: str) -> EventAccumulator:
    ea = EventAccumulator(log_dir, size_guidance=STORE_EVERYTHING_SIZE_GUIDANCE)
    ea.Reload()
    return ea


def _texts(ea: EventAccumulator) -> dict[int, str]:
    """The ``numguard/events`` text by step (``add_text`` stores it as ``<tag>/text_summary``)."""
    return {
        e.step: tensor_util.make_ndarray(e.tensor_proto).item().decode()
        for e in ea.Tensors("numguard/events/text_summary")
    }


def _expected_counters(events: list[dict[str, Any]], step: int) -> dict[str, float]:
    """Incidents up to and including ``step``: root causes only (issue 10; coverage findings are not incidents)."""
    return {
        "numguard/incidents": float(
            sum(1 for e in events if e["step"] <= step and e["kind"] != "optimizer_coverage" and e["root_cause"])
        ),
        "numguard/skipped_steps": float(FAULT_STEPS.index(step) + 1),
        "numguard/rollbacks": float(FAULT_STEPS.index(step) + 1),
    }


def _check_warnings(records: Any, events: list[dict[str, Any]], first: str) -> list[str]:
    """Every NumGuard warning repeats a root cause's message, once per kind and place; ``first`` leads.

    Consequences (``root_cause: False``) are recorded, not warned (issue 20: one NaN batch, one warning).
    """
    warned = [str(r.message) for r in records if issubclass(r.category, NumGuardWarning)]
    assert warned, "no NumGuardWarning"
    assert re.search(first, warned[0]), warned[0]
    roots = [e for e in events if e["root_cause"]]
    messages = {"NumGuard: " + e["message"] for e in roots}
    assert set(warned) <= messages, set(warned) - messages
    places = {(e["kind"], e["where"][0] if e["where"] else "") for e in roots}
    assert len(warned) == len(places), (warned, places)
    return warned


def _csv_rows(log_dir: str) -> dict[int, dict[str, str]]:
    """The rows that carry the counters (the spike series' rows every ``log_every_n_steps`` carry others)."""
    with (Path(log_dir) / "metrics.csv").open(newline="") as fh:
        return {int(row["step"]): row for row in csv.DictReader(fh) if row.get("numguard/incidents")}


# ----------------------------------------------------------------------------- TensorBoard


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Rollback run, module output poisoned at steps 3 and 6, TensorBoard logging every 50 steps."""
    tmp = tmp_path_factory.mktemp("tb")
    cb = NumGuardCallback(action="rollback", check=EVERY_CHECK, recovery={"replay": False})
    logger = TensorBoardLogger(tmp)
    with pytest.warns(NumGuardWarning, match=ANY_NUMGUARD) as records:
        tr = _fit(tmp, cb, "output", FAULT_STEPS, logger=logger, log_every_n_steps=50)
    _check_warnings(records, cb.events, OUTPUT_AT_3)
    return SimpleNamespace(tmp=tmp, cb=cb, logger=logger, trainer=tr, ea=_tb(logger.log_dir))


def test_tensorboard_counters_written_at_each_incident_step(tb_run: SimpleNamespace) -> None:
    scalar_tags = set(tb_run.ea.Tags()["scalars"])
    assert set(COUNTER_TAGS) <= scalar_tags
    events = tb_run.cb.events
    for tag in COUNTER_TAGS:
        points = [(e.step, e.value) for e in tb_run.ea.Scalars(tag)]
        # the incident steps themselves (Lightning's logging steps, every 50, are never reached in 8 steps)
        assert [s for s, _ in points] == list(FAULT_STEPS), tag
        for step, value in points:
            assert value == _expected_counters(events, step)[tag], (tag, step)
    incidents = dict((e.step, e.value) for e in tb_run.ea.Scalars("numguard/incidents"))
    assert 0 < incidents[3] < incidents[6]


def test_tensorboard_text_names_the_culprit(tb_run: SimpleNamespace) -> None:
    assert "numguard/events/text_summary" in tb_run.ea.Tags()["tensors"]
    texts = _texts(tb_run.ea)
    assert sorted(texts) == list(FAULT_STEPS)
    for step, text in texts.items():
        assert "nonfinite_output" in text
        assert "`body.1`" in text
        assert f"step {step}" in text
        assert "rollback" in text


def test_default_dirpath_is_under_trainer_log_dir(tb_run: SimpleNamespace) -> None:
    expected = Path(tb_run.tmp) / "lightning_logs" / "version_0" / "numguard"
    assert Path(tb_run.trainer.log_dir) / "numguard" == expected
    assert tb_run.cb.resolved_dirpath == expected
    assert (expected / "events.jsonl").is_file()
    assert not (Path(tb_run.tmp) / "numguard").exists()


def test_events_jsonl_fields_and_callback_events(tb_run: SimpleNamespace) -> None:
    lines = _read_jsonl(tb_run.cb.resolved_dirpath / "events.jsonl")
    assert lines, "no events were written"
    for event in lines:
        for name, typ in REQUIRED_FIELDS.items():
            assert name in event, (name, event)
            assert isinstance(event[name], typ), (name, event[name])
            assert not isinstance(event[name], bool), (name, event[name])
        assert event["kind"] in KINDS
        assert event["action"] in ACTIONS
        assert event["where"]
        assert all(isinstance(w, str) for w in event["where"])
        assert event["message"].strip()
        assert event["rank"] == 0
    assert sorted({e["step"] for e in lines}) == list(FAULT_STEPS)
    assert {e["action"] for e in lines} == {"rollback"}
    assert all(e["batch_idx"] == e["step"] and e["epoch"] == 0 for e in lines)
    assert tb_run.cb.events == lines


@pytest.mark.parametrize("action", ["skip", "warn"])
def test_first_event_of_a_step_is_the_root_cause(tmp_path: Path, action: str) -> None:
    """DESIGN: events of one step are in causal order, so the first one names the root cause.

    The poisoned module ``body.1`` also corrupts BatchNorm's running stats *during* the forward
    pass; those are an effect and must come after the module output, whatever the action.
    """
    cb = NumGuardCallback(action=action, check=EVERY_CHECK, recovery={"replay": False})
    with pytest.warns(NumGuardWarning, match=ANY_NUMGUARD) as records:
        _fit(tmp_path, cb, "output", (3,), max_steps=5)
    _check_warnings(records, cb.events, OUTPUT_AT_3)
    at_3 = [e for e in cb.events if e["step"] == 3]
    assert [e["kind"] for e in at_3][:1] == ["nonfinite_output"], [(e["kind"], e["where"]) for e in at_3]
    assert at_3[0]["where"] == ["body.1"]


# ----------------------------------------------------------------------------- other loggers


def test_csv_logger_gets_the_counters(tmp_path: Path) -> None:
    cb = NumGuardCallback(action="rollback", check=EVERY_CHECK, recovery={"replay": False})
    logger = CSVLogger(tmp_path)
    with pytest.warns(NumGuardWarning, match=LOSS_AT_3):
        _fit(tmp_path, cb, "loss", FAULT_STEPS, logger=logger, log_every_n_steps=50)
    rows = _csv_rows(logger.log_dir)
    assert sorted(rows) == list(FAULT_STEPS)  # the incident steps (Lightning logs every 50)
    for step, row in rows.items():
        for tag, value in _expected_counters(cb.events, step).items():
            assert float(row[tag]) == value, (step, tag)
    assert cb.resolved_dirpath == Path(logger.log_dir) / "numguard"


def test_tensorboard_and_csv_loggers_both_get_the_counters(tmp_path: Path) -> None:
    cb = NumGuardCallback(action="rollback", check=EVERY_CHECK, recovery={"replay": False})
    tb, csv_logger = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")
    with pytest.warns(NumGuardWarning, match=LOSS_AT_3):
        _fit(tmp_path, cb, "loss", FAULT_STEPS, logger=[tb, csv_logger], log_every_n_steps=50)
    ea = _tb(tb.log_dir)
    rows = _csv_rows(csv_logger.log_dir)
    assert sorted(rows) == list(FAULT_STEPS)  # the incident steps (Lightning logs every 50)
    for tag in COUNTER_TAGS:
        tb_points = {e.step: e.value for e in ea.Scalars(tag)}
        assert tb_points == {s: _expected_counters(cb.events, s)[tag] for s in FAULT_STEPS}, tag
        assert {s: float(r[tag]) for s, r in rows.items()} == tb_points, tag
    texts = _texts(ea)
    assert sorted(texts) == list(FAULT_STEPS)
    assert all("nonfinite_loss" in t for t in texts.values())
    # the first logger's log_dir decides the default dirpath
    assert cb.resolved_dirpath == Path(tb.log_dir) / "numguard"


def test_no_logger_writes_events_under_default_root_dir(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cb = NumGuardCallback(action="skip", check=EVERY_CHECK, recovery={"replay": False})
    with pytest.warns(NumGuardWarning, match=LOSS_AT_3):
        tr = _fit(root, cb, "loss", FAULT_STEPS, logger=False)
    assert tr.loggers == []
    assert cb.resolved_dirpath == root / "numguard"
    lines = _read_jsonl(root / "numguard" / "events.jsonl")
    assert [(e["kind"], e["step"], e["action"]) for e in lines] == [
        ("nonfinite_loss", 3, "skip"),
        ("nonfinite_loss", 6, "skip"),
    ]
    assert cb.events == lines
    assert cb.counters["skipped_steps"] == 2
    assert not (root / "lightning_logs").exists()


# ----------------------------------------------------------------------------- warnings


def test_one_warning_per_kind_and_place_not_per_step(tmp_path: Path) -> None:
    cb = NumGuardCallback(action="skip", check=EVERY_CHECK, recovery={"replay": False})
    with pytest.warns(NumGuardWarning, match=LOSS_AT_2) as records:
        _fit(tmp_path, cb, "loss", (2, 4, 6), max_steps=8)
    assert [(e["kind"], e["step"]) for e in cb.events] == [
        ("nonfinite_loss", 2),
        ("nonfinite_loss", 4),
        ("nonfinite_loss", 6),
    ]
    warned = _check_warnings(records, cb.events, LOSS_AT_2)
    assert len(warned) == 1, warned


def test_warnings_deduplicated_when_every_step_is_bad(tmp_path: Path) -> None:
    """Under ``warn`` a NaN update poisons every later step: many events, one warning per kind and place."""
    cb = NumGuardCallback(action="warn", check=EVERY_CHECK, recovery={"replay": False})
    with pytest.warns(NumGuardWarning, match=ANY_NUMGUARD) as records:
        _fit(tmp_path, cb, "output", (3,), max_steps=8)
    warned = _check_warnings(records, cb.events, OUTPUT_AT_3)
    assert len({e["step"] for e in cb.events}) >= 4
    assert len(cb.events) > len(warned)
    assert len(set(warned)) == len(warned)


# ----------------------------------------------------------------------------- message consistency

# Hints that are only true when nothing went bad earlier in the same step.
_CLAIMS_CLEAN_UPSTREAM = (
    "from finite inputs",
    "inputs and module outputs were finite",
    "the forward pass was finite",
)


@pytest.mark.parametrize(
    ("site", "first_kind", "first_where"),
    [("input", "nonfinite_input", ["batch['x']"]), ("output", "nonfinite_output", ["body.1"])],
)
def test_later_events_of_a_step_do_not_contradict_the_root_cause(
    tmp_path: Path, site: str, first_kind: str, first_where: list[str]
) -> None:
    """A NaN batch makes every module output, the loss and the gradients NaN too; their messages
    must not tell the user that the inputs (or the forward pass) were finite."""
    cb = NumGuardCallback(action="skip", check=EVERY_CHECK, recovery={"replay": False})
    with pytest.warns(NumGuardWarning, match=ANY_NUMGUARD):
        tr = trainer(tmp_path, [cb], max_steps=5)
        tr.fit(FaultModel(site=site, step=3), loader(FaultData(bad_batch=3, site=site)))
    at_3 = [e for e in cb.events if e["step"] == 3]
    assert (at_3[0]["kind"], at_3[0]["where"]) == (first_kind, first_where)
    assert len(at_3) > 1, "control: the fault had downstream consequences"
    for event in at_3[1:]:
        for claim in _CLAIMS_CLEAN_UPSTREAM:
            assert claim not in event["message"], (event["kind"], event["message"])
