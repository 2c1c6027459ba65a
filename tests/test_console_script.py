"""Tests of the ``numguard`` command line (``lightning_numguard.cli``)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from lightning_numguard import __version__, cli
from lightning_numguard.cli import build_parser, main
from lightning_numguard.reporting import explain as explain_module

EVENTS = [
    {
        "kind": "nonfinite_output",
        "step": 9,
        "epoch": 0,
        "batch_idx": 9,
        "rank": 0,
        "where": ["model_b.head"],
        "action": "warn",
        "message": "module `model_b.head` produced the first non-finite output at step 9 on rank 0",
    },
    {
        "kind": "nonfinite_input",
        "step": 4,
        "epoch": 0,
        "batch_idx": 4,
        "rank": 1,
        "where": ["batch['image']"],
        "action": "rollback",
        "message": "non-finite value in `batch['image']` at step 4 on rank 1",
        "details": {"count": 12},
    },
    {
        "kind": "op_domain",
        "step": 4,
        "epoch": 0,
        "batch_idx": 4,
        "rank": 1,
        "where": ["binary_cross_entropy"],
        "action": "rollback",
        "message": "`binary_cross_entropy` got inputs outside its domain at step 4 on rank 1",
    },
]

CUDA_LOG = """\
Epoch 2:  31%|###1      | 31/100 [00:04<00:09,  7.12it/s, v_num=0, train_loss=0.693]
/pytorch/aten/src/ATen/native/cuda/Loss.cu:115: binary_cross_entropy_out_cuda: block: [0,0,0], \
thread: [1,0,0] Assertion `input_val >= zero && input_val <= one` failed.
Traceback (most recent call last):
  File "train.py", line 61, in <module>
    trainer.fit(model, datamodule)
RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, \
opb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`
"""


@pytest.fixture
def events_file(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "numguard" / "events.jsonl"
    path.parent.mkdir(parents=True)
    lines = [json.dumps(event) for event in EVENTS]
    lines.insert(1, "{corrupt")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def cuda_log(tmp_path: Path) -> Path:
    path = tmp_path / "train.log"
    path.write_text(CUDA_LOG, encoding="utf-8")
    return path


def test_exit_codes_match_the_library() -> None:
    assert cli.ExitCode is explain_module.ExitCode
    assert (cli.ExitCode.OK, cli.ExitCode.NO_CAUSE, cli.ExitCode.ERROR) == (0, 1, 2)
    assert set(explain_module.EXIT_CODE_HELP) == set(explain_module.ExitCode)


def test_explain_events_file(events_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(events_file)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("numguard incident report\n")
    assert "  incidents:  3 in 2 step(s) (steps 4-9)" in out
    assert "First culprit: nonfinite_input at batch['image']" in out
    assert "line 2: not valid JSON" in out
    assert (
        "Actions taken: warn 1, skip 0, rollback 1, halt 0 (one per step; 1 step update(s) dropped in all)" in out
    )  # one per step


def test_explain_folder(events_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(tmp_path)]) == 0
    out, _ = capsys.readouterr()
    assert f"  file:       {events_file}" in out


def test_explain_json_for_events(events_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(events_file), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["input"] == "events"
    assert summary["exit_code"] == 0
    assert summary["events_file"] == str(events_file)
    assert summary["incidents"] == 3
    assert summary["ranks"] == [0, 1]
    assert summary["actions"] == {"warn": 1, "skip": 0, "rollback": 1, "halt": 0}  # step 4's two events: one rollback
    assert (summary["skipped_steps"], summary["rollbacks"]) == (1, 1)
    assert summary["first_culprit"]["kind"] == "nonfinite_input"
    assert summary["first_culprit"]["details"] == {"count": 12}
    assert summary["skipped_lines"] == ["line 2: not valid JSON (Expecting property name enclosed in double quotes)"]


def test_explain_log(cuda_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(cuda_log)]) == 0
    out, _ = capsys.readouterr()
    assert "Likely cause: bce_input_range (line 2)" in out
    assert "2. cuda_library_error_after_assert (line 6)" in out
    assert "BCEWithLogitsLoss" in out


def test_explain_json_for_log(cuda_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--json", str(cuda_log)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["input"] == "log"
    assert summary["likely_cause"] == "bce_input_range"
    assert [(m["name"], m["line_no"]) for m in summary["matches"]] == [
        ("bce_input_range", 2),
        ("cuda_library_error_after_assert", 6),
    ]


def test_unknown_text_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fine.log"
    path.write_text("Epoch 0: 100%|##########| 10/10\nTraining finished.\n", encoding="utf-8")
    assert main(["explain", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == f"no known cause found in {path}\n"
    assert err == ""


def test_missing_path_exits_2_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "does-not-exist.log"
    assert main(["explain", str(missing), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"numguard explain: {missing}: no such file or directory\n"


def test_binary_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"\x80\x02}q\x00(X\x05\x00\x00\x00state")
    assert main(["explain", str(path)]) == 2
    _, err = capsys.readouterr()
    assert str(path) in err
    assert "binary file" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "a subcommand is required"),
        (["explain"], "the following arguments are required: PATH"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["demo", "--fault", "everything"], "invalid choice: 'everything'"),
        (["demo", "--action", "pray"], "invalid choice: 'pray'"),
        (["demo", "--steps", "0"], "expected a positive integer, got 0"),
        (["demo", "--steps", "ten"], "expected a positive integer, got 'ten'"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert needle in err
    assert "usage: numguard" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"numguard {__version__}\n"


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: numguard [-h] [--version] {explain,demo,plot} ..." in out
    assert '1  the input was read but no known cause was recognised ("no known cause")' in out
    assert "2  usage error" in out


def test_demo_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--fault {none,input,output,loss,grad,param,masked-fill}" in out
    assert "--action {warn,skip,rollback,halt}" in out
    assert "(default: 30)" in out
    assert "(default: ./numguard-demo)" in out


def test_demo_help_describes_every_fault(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, text in cli.FAULTS.items():
        assert f"{name} {text}" in out


def test_demo_arguments_and_defaults() -> None:
    parser = build_parser()
    defaults = parser.parse_args(["demo"])
    assert (defaults.fault, defaults.action, defaults.steps, defaults.dir) == (
        "input",
        "rollback",
        30,
        "./numguard-demo",
    )
    args = parser.parse_args(["demo", "--fault", "masked-fill", "--action", "halt", "--steps", "5", "--dir", "out"])
    assert (args.fault, args.action, args.steps, args.dir) == ("masked-fill", "halt", 5, "out")


def test_demo_calls_run_demo_lazily(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[dict[str, Any]] = []

    def run_demo(**kwargs: Any) -> str:
        calls.append(kwargs)
        return "demo summary"

    # A stand-in module: the real demo trains a model, which this test does not need.
    monkeypatch.setitem(sys.modules, "lightning_numguard.doors.trainer.demo", types.SimpleNamespace(run_demo=run_demo))
    assert main(["demo", "--fault", "grad", "--action", "skip", "--steps", "3", "--dir", str(tmp_path)]) == 0
    assert calls == [{"fault": "grad", "action": "skip", "steps": 3, "out_dir": tmp_path}]
    assert capsys.readouterr().out == "demo summary\n"


def _run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_numguard", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def test_python_m_explain(cuda_log: Path, tmp_path: Path) -> None:
    result = _run_module("explain", str(cuda_log), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Likely cause: bce_input_range (line 2)" in result.stdout


def test_python_m_missing_path_has_no_traceback(tmp_path: Path) -> None:
    result = _run_module("explain", "nowhere/events.jsonl", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "nowhere/events.jsonl: no such file or directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_importing_the_cli_does_not_import_the_demo(tmp_path: Path) -> None:
    code = "import sys, lightning_numguard.cli; sys.exit('lightning_numguard.doors.trainer.demo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- issue 10: small things a user hit


def test_explain_piped_into_head_prints_no_traceback(events_file: Path, tmp_path: Path) -> None:
    # enough events that the report outgrows the pipe's buffer: the reader leaves while explain still writes
    many = [{**EVENTS[0], "step": 10 + i, "batch_idx": 10 + i} for i in range(4000)]
    events_file.write_text("".join(json.dumps(e) + "\n" for e in EVENTS + many), encoding="utf-8")
    command = f"'{sys.executable}' -m lightning_numguard explain '{events_file}' | head -1"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.stdout == "numguard incident report\n"
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr


def test_explain_reads_a_log_from_stdin(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_numguard", "explain", "-"],
        input=CUDA_LOG,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Likely cause: bce_input_range (line 2)" in result.stdout
    assert "<stdin>" in result.stdout and "stdin.log" not in result.stdout


def test_explain_of_an_empty_log_is_unreadable_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "train.log"
    empty.write_text("", encoding="utf-8")
    assert main(["explain", str(empty)]) == int(cli.ExitCode.ERROR) == 2
    out, err = capsys.readouterr()
    assert out == "" and "empty file" in err


def test_explain_json_counts_root_causes_not_consequences(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = {**EVENTS[1], "root_cause": True, "consequence_of": None}
    consequences = [
        {**EVENTS[2], "root_cause": False, "consequence_of": "nonfinite_input"},
        {**root, "kind": "nonfinite_loss", "where": ["loss"], "root_cause": False, "consequence_of": "nonfinite_input"},
    ]
    coverage = {**EVENTS[0], "kind": "optimizer_coverage", "step": 0, "where": ["head.bias"]}
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in [coverage, root, *consequences, EVENTS[0]]), encoding="utf-8")
    assert main(["explain", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["incidents"], summary["events"], summary["consequences"]) == (2, 5, 2)
    assert main(["explain", str(path)]) == 0
    # the step-0 coverage warning is no incident: neither a step with one nor the first culprit (issue 20)
    out = capsys.readouterr().out
    assert "  incidents:  2 in 2 step(s) (steps 4-9); 5 events, of them 2 consequence(s) and 1 warning(s)" in out
    assert "First culprit: nonfinite_input at batch['image']" in out
