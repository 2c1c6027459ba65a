"""``numguard explain`` on real anomaly-mode logs: it reads the forward call from "Traceback of forward call that
caused the error" and says what the guard records for that fault, as the guard does on the same run.

Each log is what a real ``Trainer(detect_anomaly=True)`` fit printed: its warnings formatted as Python prints them
on stderr, then the exception's traceback.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from instruments.diagnosis.real import ROWS
from instruments.diagnosis.real.harness import FORWARD_KINDS, Row, marker_line, run_detect_anomaly, run_guarded
from lightning_numguard.reporting.explain import ExitCode, explain
from lightning_numguard.reporting.logs import explain_log, format_log_report

USER_CODE = next(r for r in ROWS if r.name == "tab_rms_sqrt0").file


def _row(name: str) -> Row:
    return next(r for r in ROWS if r.name == name)


def _line_holding(path: str, text: str) -> int:
    (line,) = [i for i, code in enumerate(Path(path).read_text().splitlines(), 1) if text in code]
    return line


def anomaly_log(row: Row) -> tuple[str, str]:
    """The stderr of ``row``'s fit with ``detect_anomaly=True`` (no guard), and its exception's last line."""
    with tempfile.TemporaryDirectory() as root:
        said, log = run_detect_anomaly(row, root)
    assert said.startswith("RuntimeError: Function"), said
    return log, log.rstrip().splitlines()[-1]


@pytest.fixture(scope="module")
def between() -> tuple[str, str]:
    """A NaN made in the LightningModule's forward (``x * nan``): anomaly mode stops at the loss's node."""
    return anomaly_log(_row("gpt_between"))


def test_a_forward_fault_is_read_from_the_forward_traceback(between: tuple[str, str]) -> None:
    text, _ = between
    (match,) = [m for m in explain_log(text) if m.name == "anomaly_nan_in_backward"]
    assert match.groups["op"] == "LogSoftmaxBackward0"
    forward = match.forward
    assert forward is not None
    line = _line_holding(USER_CODE, "return F.cross_entropy(logits.reshape(-1, VOCAB)")
    assert (Path(forward.file).name, forward.line, forward.op) == ("user_code.py", line, "cross_entropy")
    assert forward.code.startswith("return F.cross_entropy(")
    assert match.guard_kind == "nonfinite_loss"
    report = format_log_report([match], "train.log")
    assert f"user_code.py:{line}" in report and "forward fault" in report
    assert "nonfinite_grad" not in report and "sqrt/pow/norm" not in report
    assert "anomaly mode prints its forward traceback just above" not in report
    with tempfile.TemporaryDirectory() as root:
        event = run_guarded(_row("gpt_between"), root).event
    assert event["kind"] in FORWARD_KINDS  # the guard, on the same fault, records a forward fault too


def test_a_backward_fault_is_read_as_the_guard_records_it() -> None:
    """``sqrt(0)`` in an RMS norm: anomaly mode's node and forward line are the guard's nonfinite_grad event."""
    row = _row("tab_rms_sqrt0")
    text, _ = anomaly_log(row)
    (match,) = [m for m in explain_log(text) if m.name == "anomaly_nan_in_backward"]
    forward = match.forward
    assert forward is not None
    line = marker_line(row.file, "rms-sqrt")
    assert (match.groups["op"], forward.line, forward.op) == ("SqrtBackward0", line, "sqrt")
    assert match.guard_kind == "nonfinite_grad"
    assert f"nonfinite_grad, op SqrtBackward0, at {forward.file}:{line}" in match.guard
    with tempfile.TemporaryDirectory() as root:
        event = run_guarded(row, root).event
    assert (event["kind"], event["op"], event["source"]) == ("nonfinite_grad", "SqrtBackward0", f"{row.file}:{line}")


def test_an_mse_loss_fed_a_forward_nan_is_a_forward_fault() -> None:
    text, _ = anomaly_log(_row("tab_log_zero"))
    (match,) = [m for m in explain_log(text) if m.name == "anomaly_nan_in_backward"]
    assert match.forward is not None and match.forward.op == "mse_loss"
    assert match.guard_kind == "nonfinite_loss" and "forward fault" in match.guard


def test_without_the_forward_traceback_it_says_which_run_names_it(between: tuple[str, str]) -> None:
    """Only the exception's message (the warning on stderr was not kept): no line to read, so it says to run the
    script with the guard, and names no gradient kind for a loss's node."""
    _, error = between
    (match,) = explain_log(error)
    assert match.forward is None and match.guard_kind == "nonfinite_output"
    assert "no forward traceback" in match.guard and "NumGuardCallback()" in match.guard


def test_the_cli_reads_a_real_anomaly_log(between: tuple[str, str], tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text(between[0], encoding="utf-8")
    result = explain(log)
    assert result.exit_code == ExitCode.OK
    first = result.summary["matches"][0]
    assert first["name"] == "anomaly_nan_in_backward" and first["hint_kind"] == "nonfinite_loss"
    assert Path(first["forward"]["file"]).name == "user_code.py" and first["forward"]["op"] == "cross_entropy"
    assert "forward call: " in result.text


def test_a_log_from_another_machine_is_read_from_its_paths() -> None:
    """Paths that do not exist here: site-packages' torch and Lightning frames and the stdlib are not the user's,
    ``transformers`` is; a block with no user frame gives no call."""
    from tests.reporting.test_explain import ANOMALY_DIV

    (match,) = explain_log(ANOMALY_DIV)
    assert match.forward is not None
    assert (match.forward.file, match.forward.line, match.forward.op) == ("train.py", 18, "div")
    assert match.guard_kind == "nonfinite_output"
    hf = "/home/u/venv/lib/python3.11/site-packages/transformers/models/t5/modeling_t5.py"
    log = (
        "UserWarning: Error detected in MulBackward0. Traceback of forward call that caused the error:\n"
        '  File "/usr/lib/python3.11/runpy.py", line 88, in _run_code\n    exec(code, run_globals)\n'
        f'  File "{hf}", line 94, in forward\n    hidden_states = self.wo(hidden_states)\n'
        '  File "/home/u/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1, in _call_impl\n'
        "    return forward_call(*args, **kwargs)\n"
        " (Triggered internally at python_anomaly_mode.cpp:122.)\n"
        "RuntimeError: Function 'MulBackward0' returned nan values in its 0th output.\n"
    )
    (match,) = explain_log(log)
    assert match.forward is not None and (match.forward.file, match.forward.line) == (hf, 94)
    only_torch = log.replace(hf, "/home/u/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py")
    (match,) = explain_log(only_torch)
    assert match.forward is None and "no forward traceback" in match.guard
