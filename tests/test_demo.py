"""`numguard demo` end to end, and `numguard explain` on what a real run wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_numguard.cli import fault_step, main
from lightning_numguard.doors.trainer.demo import run_demo
from lightning_numguard.reporting.events import read_events


@pytest.mark.parametrize(
    ("fault", "action", "kind", "where"),
    [
        ("input", "rollback", "nonfinite_input", "batch['image']"),
        ("masked-fill", "skip", "suspicious_input", "batch['image']"),
        ("output", "halt", "nonfinite_output", "norm"),
    ],
)
def test_demo_finds_names_and_survives(tmp_path, capsys, fault, action, kind, where):
    code = main(["demo", "--fault", fault, "--action", action, "--steps", "16", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert f"{kind} at step 8 in {where}" in out
    assert "weights finite at the end: True" in out
    (events_file,) = tmp_path.rglob("events.jsonl")
    events, problems = read_events(events_file)
    assert problems == []
    first = events[0]
    assert first["kind"] == kind and first["where"][0] == where and first["action"] == action
    assert str(events_file) in out

    # the run's folder explains itself
    assert main(["explain", str(events_file.parent)]) == 0
    report = capsys.readouterr().out
    assert kind in report and where in report


def test_demo_without_a_fault_reports_nothing(tmp_path):
    text = run_demo(fault="none", action="rollback", steps=6, out_dir=tmp_path)
    assert "no incident found (as expected: no fault injected)" in text


def test_demo_rejects_an_unknown_fault(tmp_path):
    with pytest.raises(ValueError, match=r"`fault` must be one of .*got 'gremlins'"):
        run_demo(fault="gremlins", out_dir=tmp_path)


def test_demo_without_a_fault_prints_no_path_that_does_not_exist(tmp_path):
    text = run_demo(fault="none", action="rollback", steps=6, out_dir=tmp_path / "demo")
    paths = [word for line in text.splitlines() for word in line.split() if "/" in word]
    assert all(Path(p).exists() for p in paths), text
    assert "events.jsonl" not in text and "numguard explain" not in text


def test_demo_help_says_when_the_fault_comes_and_has_no_explain_exit_codes(capsys):
    assert main(["demo", "--help"]) == 0
    text = capsys.readouterr().out
    assert f"at global step {fault_step(30)}" in text
    assert "no known cause" not in text and "PATH missing" not in text
    assert "0  the demo ran" in text
