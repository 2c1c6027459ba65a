"""Tests of ``lightning_numguard.reporting.explain`` and its catalogue."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_numguard.reporting.catalogue import CATALOGUE
from lightning_numguard.reporting.events import KINDS, read_events
from lightning_numguard.reporting.explain import (
    ExitCode,
    explain,
    explain_log,
    explain_path,
    find_events_files,
    first_culprit,
    format_log_report,
    format_report,
    summarize_events,
)
from lightning_numguard.reporting.hints import KIND_HINTS, kind_hint, op_hint

# --------------------------------------------------------------------------- log snippets
# Exact texts from the two seed posts where they exist, otherwise torch's own wording.

SEED_CUDA_BCE = """\
In [7]: C:wbwindowspytorchatensrcATennativecudaLoss.cu:115: block: [0,0,0], thread: [1,0,0] \
Assertion `input_val >= zero && input_val <= one` failed.
C:wbwindowspytorchatensrcATennativecudaLoss.cu:115: block: [0,0,0], thread: [2,0,0] \
Assertion `input_val >= zero && input_val <= one` failed.
"""

SEED_CPU_BCE = """\
---------------------------------------------------------------------------
RuntimeError                              Traceback (most recent call last)
 in
      1 input=torch.Tensor([[1, 2], [2, 1]])
      2 target=torch.Tensor([[0, 1], [1, 0]])
----> 3 loss = F.binary_cross_entropy(input, target)

D:Miniconda3envsdllibsite-packagestorchnnfunctional.py in binary_cross_entropy(input, target, weight, \
size_average, reduce, reduction)
   2913         weight = weight.expand(new_size)
   2914
-> 2915     return torch._C._nn.binary_cross_entropy(input, target, weight, reduction_enum)
   2916
   2917

RuntimeError: all elements of input should be between 0 and 1
"""

# Seed 003's "general error" block, verbatim (the xxx placeholders are the post's).
SEED_GENERAL = """\
xxx.py:xxx: RuntimeWarning: overflow encountered in reduce
xxx.py:xxx: RuntimeWarning: invalid value encountered in true_divide
...
xxx.cu:xxx: block: [xxx,0,0], thread: [0,0,0] Assertion `input_val >= zero && input_val <= xxx` failed.
xxx.cu:xxx: block: [xxx,0,0], thread: [1,0,0] Assertion `input_val >= zero && input_val <= xxx` failed.
xxx.cu:xxx: block: [xxx,0,0], thread: [2,0,0] Assertion `input_val >= zero && input_val <= xxx` failed.
xxx.cu:xxx: block: [xxx,0,0], thread: [3,0,0] Assertion `input_val >= zero && input_val <= xxx` failed.
xxx.cu:xxx: block: [xxx,0,0], thread: [4,0,0] Assertion `input_val >= zero && input_val <= xxx` failed.
xxx.cu:xxx: block: [xxx,0,0], thread: [5,0,0] Assertion `input_val >= zero && input_val <= xxx` failed.
...
RuntimeError: CUDA error: device-side assert triggered
CUDA kernel errors might be asynchronously reported at some other API call,\
so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1.
"""

SEED_NUMPY_OVERFLOW = """\
In [55]: arr.data.sum()
D:Miniconda3envsdllibsite-packagesnumpycore_methods.py:47: RuntimeWarning: overflow encountered in reduce
  return umr_sum(a, axis, dtype, out, keepdims, initial, where)
Out[55]: inf
"""

ANOMALY_DIV = """\
/venv/lib/python3.11/site-packages/torch/autograd/graph.py:979: UserWarning: Error detected in DivBackward0. \
Traceback of forward call that caused the error:
  File "train.py", line 18, in normalise
    return (x - x.mean()) / x.std()
 (Triggered internally at /pytorch/torch/csrc/autograd/python_anomaly_mode.cpp:122.)
  return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass
Traceback (most recent call last):
  File "train.py", line 40, in <module>
    loss.backward()
RuntimeError: Function 'DivBackward0' returned nan values in its 1th output.
"""

NLL_CUDA = (
    "/pytorch/aten/src/ATen/native/cuda/Loss.cu:240: nll_loss_forward_reduce_cuda_kernel_2d: "
    "block: [0,0,0], thread: [5,0,0] Assertion `t >= 0 && t < n_classes` failed."
)
EMBEDDING_CUDA = (
    "../aten/src/ATen/native/cuda/Indexing.cu:1146: indexSelectLargeIndex: block: [111,0,0], "
    "thread: [64,0,0] Assertion `srcIndex < srcSelectDimSize` failed."
)
CUBLAS_SGEMM = (
    "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, "
    "opb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"
)
CUDNN_INTERNAL = "RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"
DEVICE_ASSERT = "RuntimeError: CUDA error: device-side assert triggered"
DISTRIBUTION = (
    "ValueError: Expected parameter loc (Tensor of shape (3,)) of distribution Normal(loc: "
    "torch.Size([3]), scale: torch.Size([3])) to satisfy the constraint Real(), but found invalid "
    "values:\ntensor([nan, 0., 0.])"
)

LOG_SNIPPETS: list[tuple[str, str]] = [
    ("bce_input_range", SEED_CUDA_BCE),
    ("bce_input_range", SEED_CPU_BCE),
    ("bce_input_range", SEED_GENERAL.splitlines()[3]),
    ("class_index_out_of_bounds", NLL_CUDA),
    (
        "class_index_out_of_bounds",
        "/pytorch/aten/src/THCUNN/ClassNLLCriterion.cu:108: cunn_ClassNLLCriterion_updateOutput_kernel: "
        "block: [0,0,0], thread: [3,0,0] Assertion `t >= 0 && t < n_classes` failed.",
    ),
    (
        "class_index_out_of_bounds",
        '  File "train.py", line 31, in training_step\n'
        "    loss = F.cross_entropy(logits, y)\n"
        "IndexError: Target 10 is out of bounds.",
    ),
    ("class_index_out_of_bounds", "Target -1 is out of bounds."),
    (
        "embedding_index_out_of_range",
        '  File "model.py", line 12\n    x = self.emb(ids)\nIndexError: index out of range in self',
    ),
    ("embedding_index_out_of_range", EMBEDDING_CUDA),
    (
        "embedding_index_out_of_range",
        "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:702: indexSelectSmallIndex: block: [0,0,0], "
        "thread: [0,0,0] Assertion `srcIndex < srcSelectDimSize` failed.",
    ),
    ("anomaly_nan_in_backward", ANOMALY_DIV),
    (
        "anomaly_nan_in_backward",
        "RuntimeError: Function 'SqrtBackward0' returned nan values in its 0th output.",
    ),
    ("numpy_overflow", SEED_NUMPY_OVERFLOW),
    ("numpy_overflow", SEED_GENERAL.splitlines()[0]),
    ("numpy_invalid_value", SEED_GENERAL.splitlines()[1]),
    (
        "numpy_invalid_value",
        "prep.py:12: RuntimeWarning: invalid value encountered in divide\n  x = x / x.std(0)",
    ),
    ("numpy_invalid_value", "prep.py:9: RuntimeWarning: divide by zero encountered in log"),
    (
        "grad_norm_nonfinite",
        "RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
        "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
        "set `error_if_nonfinite=False`",
    ),
    (
        "grad_scaler_no_inf_checks",
        '  File "/venv/lib/python3.11/site-packages/torch/amp/grad_scaler.py", line 476, in step\n'
        '    raise AssertionError("No inf checks were recorded for this optimizer.")\n'
        "AssertionError: No inf checks were recorded for this optimizer.",
    ),
    ("grad_scaler_no_inf_checks", "AssertionError: No inf checks were recorded prior to update."),
    ("amp_fp16_params", "ValueError: Attempting to unscale FP16 gradients."),
    ("loss_scale_collapse", "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.0001"),
    (
        "loss_scale_collapse",
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2, reducing to 1\n"
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
    ),
    ("distribution_invalid_parameter", DISTRIBUTION),
    ("loss_nonfinite", "Loss is nan, stopping training"),
    ("loss_nonfinite", "Epoch 3:  45%|####5     | 45/100 [00:10<00:12,  4.50it/s, v_num=0, train_loss=nan]"),
    (
        "loss_nonfinite",
        "Monitored metric val_loss = nan is not finite. Previous best value was 0.412. Signaling Trainer to stop.",
    ),
    (
        "cuda_kernel_assert",
        "/pytorch/aten/src/ATen/native/cuda/ScatterGatherKernel.cu:367: operator(): block: [0,0,0], "
        'thread: [0,0,0] Assertion `idx_dim >= 0 && idx_dim < index_size && "index out of bounds"` failed.',
    ),
    ("cuda_library_error_after_assert", CUBLAS_SGEMM),
    (
        "cuda_library_error_after_assert",
        "RuntimeError: CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
    ),
    ("cuda_library_error_after_assert", "RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
    ("cuda_library_error_after_assert", CUDNN_INTERNAL),
    ("cuda_library_error_after_assert", "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ("cuda_device_assert", DEVICE_ASSERT),
    ("cuda_device_assert", "RuntimeError: CUDA error: device-side assert triggered的解决"),
    (
        "training_loss_spike",
        "lightning.fabric.utilities.spike.TrainingSpikeException: Training spike detected in batch 41",
    ),
    (
        "training_loss_spike",
        "llmfoundry.utils.exceptions.LossSpikeError: Training stopped due to a loss spike. The training loss was "
        "more than 2 times greater than the running average loss",
    ),
]


@pytest.mark.parametrize(("name", "snippet"), LOG_SNIPPETS)
def test_catalogue_entry_matches_its_log(name: str, snippet: str) -> None:
    matches = explain_log(snippet)
    assert [match.name for match in matches] == [name]
    match = matches[0]
    lines = snippet.splitlines()
    assert match.line == lines[match.line_no - 1].strip()
    assert match.cause
    assert match.fix
    assert match.pattern.hint_kind in KINDS


def test_every_catalogue_entry_has_a_log_snippet() -> None:
    names = [pattern.name for pattern in CATALOGUE]
    assert len(names) == len(set(names))
    assert set(names) == {name for name, _ in LOG_SNIPPETS}


@pytest.mark.parametrize(
    "line",
    [
        "Epoch 1: 100%|##########| 100/100 [00:03<00:00, 30.1it/s, v_num=1, train_loss=0.352]",
        "val_loss improved from 0.41 to 0.38, saving model",
        "Validation sanity check: 0it [00:00, ?it/s]",
        "loss: infinity-norm clipping enabled",
        "NaN check passed: 0 nan values in batch",
        "INFO: GPU available: True (cuda), used: True",
    ],
)
def test_benign_lines_match_nothing(line: str) -> None:
    assert explain_log(line) == []


def test_bce_fix_names_bce_with_logits_and_the_guard() -> None:
    (match,) = explain_log(SEED_CUDA_BCE)
    assert "BCEWithLogitsLoss" in match.fix
    assert "NumGuardCallback" in match.fix
    assert "upstream NaN" in match.cause
    assert match.count == 2


@pytest.mark.parametrize(
    ("op", "needle"),
    [
        ("SqrtBackward0", "eps inside the root"),
        ("DivBackward0", "std + 1e-8"),
        ("LogBackward0", "clamp_min"),
        ("PowBackward0", "fractional exponent"),
    ],
)
def test_anomaly_names_the_op_with_its_hint(op: str, needle: str) -> None:
    (match,) = explain_log(f"RuntimeError: Function '{op}' returned nan values in its 0th output.")
    assert match.groups["op"] == op
    assert op in match.cause
    assert needle in match.fix
    assert needle in (op_hint(op) or "")


def test_anomaly_of_an_unknown_op_still_names_it() -> None:
    (match,) = explain_log("RuntimeError: Function 'MyFuncBackward' returned nan values in its 2nd output.")
    assert "MyFuncBackward" in match.cause
    assert op_hint("MyFuncBackward") is None
    assert "{" not in match.fix


def test_distribution_match_names_the_parameter() -> None:
    (match,) = explain_log(DISTRIBUTION)
    assert match.groups == {"param": "loc", "constraint": "Real()"}
    assert "'loc'" in match.cause


def test_line_is_attributed_to_the_most_specific_entry_only() -> None:
    matches = explain_log(SEED_CUDA_BCE + EMBEDDING_CUDA)
    assert [m.name for m in matches] == ["bce_input_range", "embedding_index_out_of_range"]


def test_cuda_assert_before_cublas_errors_is_the_root_cause() -> None:
    log = "\n".join(
        [
            "Epoch 0:  12%|#2        | 12/100 [00:01<00:09, 9.71it/s, v_num=3, train_loss=4.21]",
            EMBEDDING_CUDA,
            EMBEDDING_CUDA.replace("[64,0,0]", "[65,0,0]"),
            "Traceback (most recent call last):",
            '  File "train.py", line 88, in training_step',
            "    h = self.proj(x)",
            CUBLAS_SGEMM,
            CUDNN_INTERNAL,
            DEVICE_ASSERT,
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
        ]
    )
    matches = explain_log(log)
    assert [(m.name, m.line_no, m.count) for m in matches] == [
        ("embedding_index_out_of_range", 2, 2),
        ("cuda_library_error_after_assert", 7, 2),
        ("cuda_device_assert", 9, 1),
    ]
    report = format_log_report(matches, "train.log")
    assert report.index("Likely cause: embedding_index_out_of_range (line 2, 2 matching lines)") < report.index(
        "2. cuda_library_error_after_assert (line 7"
    )


def test_follow_on_errors_never_outrank_a_later_cause() -> None:
    # The traceback went to stderr before the kernel's printf reached stdout.
    log = f"{DEVICE_ASSERT}\n{CUDNN_INTERNAL}\n{NLL_CUDA}\n"
    assert [m.name for m in explain_log(log)] == [
        "class_index_out_of_bounds",
        "cuda_device_assert",
        "cuda_library_error_after_assert",
    ]


def test_seed_general_block_in_order_of_appearance() -> None:
    matches = explain_log(SEED_GENERAL)
    assert [(m.name, m.line_no) for m in matches] == [
        ("numpy_overflow", 1),
        ("numpy_invalid_value", 2),
        ("bce_input_range", 4),
        ("cuda_device_assert", 11),
    ]
    assert matches[2].count == 6


def test_explain_log_accepts_lines() -> None:
    assert [m.name for m in explain_log(iter(SEED_CPU_BCE.splitlines()))] == ["bce_input_range"]


def test_long_lines_are_shortened_in_the_quote() -> None:
    (match,) = explain_log("x" * 1000 + " Loss is nan")
    assert len(match.line) <= 240
    assert match.line.endswith("...")


def test_format_log_report_without_matches() -> None:
    assert format_log_report([], "a.log") == "no known cause found in a.log"


def test_every_kind_has_a_hint() -> None:
    assert set(KIND_HINTS) == set(KINDS)
    assert "does not describe" in kind_hint("brand_new_kind")


def test_match_to_dict_is_json() -> None:
    (match,) = explain_log("RuntimeError: Function 'SqrtBackward0' returned nan values in its 0th output.")
    data = json.loads(json.dumps(match.to_dict()))
    assert data["name"] == "anomaly_nan_in_backward"
    assert data["line_no"] == 1
    assert data["groups"]["op"] == "SqrtBackward0"
    assert data["hint_kind"] == "nonfinite_grad"


# --------------------------------------------------------------------------- events.jsonl


def _event(kind: str, step: int, where: str, action: str = "rollback", rank: int = 0, **extra: Any) -> dict:
    return {
        "kind": kind,
        "step": step,
        "epoch": step // 10,
        "batch_idx": step % 10,
        "rank": rank,
        "where": [where],
        "action": action,
        "message": f"{kind} in `{where}` at step {step} on rank {rank}",
        **extra,
    }


EVENTS = [
    # Recorded after a resume: a later step comes first in the file.
    _event("nonfinite_loss", 31, "loss", action="warn"),
    _event("nonfinite_input", 12, "batch['image']", rank=1, details={"max_abs": "inf", "count": 3}),
    _event(
        "nonfinite_output",
        12,
        "model_a.body.3",
        rank=1,
        replay={"module": "model_a.body.3", "op": "SqrtBackward0"},
    ),
    _event("op_domain", 12, "binary_cross_entropy", rank=1, time=1764500000.0),
    _event("nonfinite_grad", 13, "layer.weight", action="skip"),
    _event("nonfinite_param", 20, "layer.weight", action="halt"),
]


def _write_events(path: Path, events: list[dict], extra_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps(event) for event in events]
    lines[2:2] = extra_lines
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def events_file(tmp_path: Path) -> Path:
    return _write_events(tmp_path / "events.jsonl", EVENTS)


def test_read_events_round_trips(events_file: Path) -> None:
    events, problems = read_events(events_file)
    assert events == EVENTS
    assert problems == []


def test_first_culprit_is_first_event_of_earliest_step() -> None:
    assert first_culprit(EVENTS) is EVENTS[1]
    assert first_culprit([]) is None


def test_report_of_hand_written_events(events_file: Path) -> None:
    events, problems = read_events(events_file)
    report = format_report(events, events_file, problems)
    lines = report.splitlines()

    assert f"  file:       {events_file}" in lines
    assert "  incidents:  6 in 4 step(s) (steps 12-31)" in lines
    assert "  ranks:      0, 1" in lines
    assert "First culprit: nonfinite_input at batch['image']" in lines
    assert "  step 12, epoch 1, batch 2, rank 1; action: rollback" in lines
    assert "  message: nonfinite_input in `batch['image']` at step 12 on rank 1" in lines
    actions = "Actions taken: warn 1, skip 1, rollback 1, halt 1 (one per step; 3 step update(s) dropped in all)"  # one per step
    assert actions in lines

    start = lines.index("Timeline (in recorded order; '>' marks the first culprit)")
    timeline = lines[start + 1 : lines.index(actions)]
    assert timeline[0].split() == ["step", "epoch/batch", "rank", "kind", "where", "action"]
    rows = [line for line in timeline if re.match(r"^  [> ] \d", line)]
    assert len(rows) == len(EVENTS)
    assert [row.split()[-1] for row in rows] == [event["action"] for event in EVENTS]
    marked = [row for row in rows if row.startswith("  > ")]
    assert len(marked) == 1
    assert marked[0].split()[1:6] == ["12", "1/2", "1", "nonfinite_input", "batch['image']"]
    assert rows[0].split()[:4] == ["31", "3/1", "0", "nonfinite_loss"]

    # Optional keys are shown under their event.
    assert "        details: max_abs=inf, count=3" in lines
    assert "        replay:  module model_a.body.3, op SqrtBackward0" in lines
    assert "        time:    2025-11-30T10:53:20+00:00" in lines
    # One hint per root cause (every hand-written event is one).
    hints = lines[lines.index("Hints (one per root cause; consequences follow from it)") + 1 :]
    assert [line.split()[0] for line in hints if not line.startswith("    ")] == [
        "nonfinite_loss",
        "nonfinite_input",
        "nonfinite_output",
        "op_domain",
        "nonfinite_grad",
        "nonfinite_param",
    ]


def test_hints_are_the_root_causes_own_and_repeated_steps_are_one_line(tmp_path: Path) -> None:
    """Before: a generic hint for every kind present, consequences included ("compute the loss in its numerically
    stable form" after an exp overflow), and every rolled-back step's events printed again in full."""
    replay = {"op": "exp", "forward_module": "dec.net.0", "stage": "forward", "max_in": 1611.3, "dtype": "float32",
              "made": "inf", "forward_op": "exp"}  # fmt: skip
    after = "nonfinite_output in `MyVAE`"
    consequence = {"action": "rollback", "root_cause": False, "consequence_of": "nonfinite_output"}
    events = []
    for step in (5, 6, 7):
        events += [
            _event(
                "nonfinite_output",
                step,
                "MyVAE",
                details={"own_code": True, "replay": replay},
                module="MyVAE",
                op="exp",
            ),
            _event("nonfinite_loss", step, "loss", details={"values": ["nan"], "after": after}, **consequence),
            _event("nonfinite_grad", step, "enc.weight", details={"after": after}, **consequence),
        ]
    report = format_report(events, tmp_path / "events.jsonl")
    lines = report.splitlines()
    hints = lines[lines.index("Hints (one per root cause; consequences follow from it)") + 1 :]
    assert hints[0].startswith("  nonfinite_output in MyVAE (3): the exponent reached 1611.3; exp overflows float32"), (
        hints
    )
    assert KIND_HINTS["nonfinite_loss"] not in report.replace("\n    ", " ")  # no hint for a consequence
    assert not any(line.startswith("  nonfinite_loss") for line in hints)
    # steps 6 and 7 repeated step 5's events exactly: one line
    assert "    ... steps 6, 7: the same 3 events as step 5, action rollback" in lines
    assert len([line for line in lines if re.match(r"^  [> ] \d", line)]) == 3
    # a consequence is one line saying what it followed; the replay's two modules are told apart
    assert '        consequence of nonfinite_output in `MyVAE` (not counted); values=["nan"]' in lines
    assert "first module output holding it: dec.net.0 (which only received it from MyVAE)" in report
    assert "  module: MyVAE (the module that ran the op)" in lines


def test_culprit_with_a_replayed_op_gets_the_op_hint(tmp_path: Path) -> None:
    nested = _event("nonfinite_grad", 3, "norm.weight", details={"replay": {"module": "norm", "op": "SqrtBackward0"}})
    report = format_report([nested], tmp_path / "events.jsonl")
    assert "  hint:    SqrtBackward0: sqrt's gradient" in report
    assert "replay:  module norm, op SqrtBackward0" in report
    assert "details:" not in report


def test_summary_counts(events_file: Path) -> None:
    summary = summarize_events(EVENTS, events_file)
    assert summary["incidents"] == 6
    assert summary["steps"] == [12, 13, 20, 31]
    assert (summary["first_step"], summary["last_step"]) == (12, 31)
    assert summary["ranks"] == [0, 1]
    assert summary["kinds"] == {
        "nonfinite_loss": 1,
        "nonfinite_input": 1,
        "nonfinite_output": 1,
        "op_domain": 1,
        "nonfinite_grad": 1,
        "nonfinite_param": 1,
    }
    assert summary["actions"] == {"warn": 1, "skip": 1, "rollback": 1, "halt": 1}  # step 12's 3 events: 1 rollback
    assert (summary["skipped_steps"], summary["rollbacks"]) == (3, 1)
    assert summary["first_culprit"]["where"] == ["batch['image']"]
    assert summary["first_culprit"]["hint"] == KIND_HINTS["nonfinite_input"]
    json.dumps(summary)


def test_corrupt_lines_are_skipped_with_their_line_numbers(tmp_path: Path) -> None:
    bad = (
        '{"kind": "nonfinite_loss", "step": 4',  # truncated by a crash
        "[1, 2, 3]",
        json.dumps({key: value for key, value in EVENTS[0].items() if key != "rank"}),
        json.dumps({**EVENTS[0], "step": "12"}),
        json.dumps({**EVENTS[0], "step": True}),
        json.dumps({**EVENTS[0], "where": [1]}),
        "",
    )
    path = _write_events(tmp_path / "events.jsonl", EVENTS, bad)
    with path.open("ab") as stream:
        stream.write(b'{"kind": "\xff"}\n')
    events, problems = read_events(path)
    assert events == EVENTS
    assert problems == [
        "line 3: not valid JSON (Expecting ',' delimiter)",
        "line 4: not a JSON object (got list)",
        "line 5: missing required key 'rank'",
        "line 6: 'step' must be an int, got str",
        "line 7: 'step' must be an int, got bool",
        "line 8: 'where' must be a list of strings",
        "line 14: not UTF-8 text (invalid start byte at byte 10)",
    ]
    text, code = explain_path(path)
    assert code == ExitCode.OK
    assert "  skipped:    7 corrupt line(s)" in text
    assert "line 3: not valid JSON" in text
    assert "First culprit: nonfinite_input at batch['image']" in text


def test_empty_events_file_means_no_incidents(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    text, code = explain_path(path)
    assert code == ExitCode.OK
    assert text.endswith("no incidents recorded")
    assert explain(path).summary["incidents"] == 0


def test_events_file_with_nothing_parseable_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("garbage\n{not json\n", encoding="utf-8")
    text, code = explain_path(path)
    assert code == ExitCode.ERROR
    assert str(path) in text
    assert "no valid event in 2 non-empty line(s): line 1: not valid JSON" in text


def test_folder_uses_the_newest_events_file(tmp_path: Path) -> None:
    old = _write_events(tmp_path / "run1" / "numguard" / "events.jsonl", [EVENTS[0]])
    new = _write_events(tmp_path / "run2" / "deep" / "numguard" / "events.jsonl", EVENTS)
    os.utime(old, (1_000_000, 1_000_000))
    os.utime(new, (2_000_000, 2_000_000))
    assert find_events_files(tmp_path) == [new, old]

    result = explain(tmp_path)
    assert result.exit_code == ExitCode.OK
    assert f"  file:       {new}" in result.text
    assert "(the newest of 2 events.jsonl files; not used:)" in result.text
    assert str(old) in result.text
    assert "incidents:  6" in result.text
    assert result.summary["events_file"] == str(new)
    assert result.summary["other_events_files"] == [str(old)]


def test_folder_without_events_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "train.log").write_text("Loss is nan\n", encoding="utf-8")
    text, code = explain_path(tmp_path)
    assert code == ExitCode.ERROR
    assert text == f"numguard explain: {tmp_path}: no events.jsonl found in this folder or below it"


def test_jsonl_content_under_another_name_is_read_as_events(tmp_path: Path) -> None:
    path = _write_events(tmp_path / "incidents.log", EVENTS, ("not json",))
    result = explain(path)
    assert result.exit_code == ExitCode.OK
    assert result.summary["input"] == "events"
    assert result.summary["incidents"] == 6


def test_text_log_is_explained(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_text(SEED_GENERAL, encoding="utf-8")
    result = explain(path)
    assert result.exit_code == ExitCode.OK
    assert result.text.startswith(f"numguard explain: {path}\n\nLikely cause: numpy_overflow (line 1)\n")
    assert "  > xxx.py:xxx: RuntimeWarning: overflow encountered in reduce" in result.text
    assert result.summary["likely_cause"] == "numpy_overflow"
    assert [m["name"] for m in result.summary["matches"]] == [
        "numpy_overflow",
        "numpy_invalid_value",
        "bce_input_range",
        "cuda_device_assert",
    ]


def test_unknown_text_has_no_known_cause(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_text("Epoch 0: 100%|##########| 10/10 [00:01<00:00]\nall good\n", encoding="utf-8")
    text, code = explain_path(path)
    assert code == ExitCode.NO_CAUSE
    assert text == f"no known cause found in {path}"


def test_non_utf8_log_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_bytes(b"caf\xe9 \xff\nRuntimeError: all elements of input should be between 0 and 1\n")
    result = explain(path)
    assert result.exit_code == ExitCode.OK
    assert result.summary["matches"][0]["line_no"] == 2


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "events.jsonl"
    text, code = explain_path(missing)
    assert code == ExitCode.ERROR
    assert text == f"numguard explain: {missing}: no such file or directory"


def test_binary_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"PK\x03\x04\x00\x00binary\x00data")
    text, code = explain_path(path)
    assert code == ExitCode.ERROR
    assert str(path) in text
    assert "binary file" in text


# Seed 000's first story as a user's log shows it: the traceback ends in BCE, then the device-side assert; the
# kernel's "Assertion ... failed" line went to a stderr this log did not capture.
BCE_TRACEBACK_ONLY = """\
Epoch 3:  41%|####1     | 412/1000 [02:13<03:10, 3.09it/s, loss=0.0712]
Traceback (most recent call last):
  File "train.py", line 120, in <module>
    loss = criterion(netB(netA(lr)), target)
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/loss.py", line 699, in forward
    return F.binary_cross_entropy(input, target, weight=self.weight, reduction=self.reduction)
  File "/venv/lib/python3.11/site-packages/torch/nn/functional.py", line 3560, in binary_cross_entropy
    return torch._C._nn.binary_cross_entropy(input, target, weight, reduction_enum)
RuntimeError: CUDA error: device-side assert triggered
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be \
incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1.
"""


def _lines_referred_to(report: str, log: str) -> None:
    """Every "(line N" of the report is a line of ``log``, quoted as it is there."""
    lines = log.splitlines()
    for number, quote in re.findall(r"\(line (\d+)[^\n]*\n  > ([^\n]*)", report):
        assert 1 <= int(number) <= len(lines) and lines[int(number) - 1].strip() == quote


def test_device_assert_after_a_bce_traceback_names_bce_its_domain_and_the_upstream_nan(tmp_path: Path) -> None:
    """Before: only the generic device-assert advice, sending the reader to an 'Assertion ... failed' line that
    the log does not have."""
    path = tmp_path / "train.log"
    path.write_text(BCE_TRACEBACK_ONLY, encoding="utf-8")
    result = explain(path)
    assert result.exit_code == ExitCode.OK
    assert result.summary["likely_cause"] == "bce_input_range"
    text = result.text
    likely = text.split("Also found")[0]
    assert "binary_cross_entropy" in likely and "[0, 1]" in likely and "upstream NaN" in likely
    assert "BCEWithLogitsLoss" in likely
    assert "line in the log is the real cause" not in text and "Look for an earlier 'Assertion" not in text
    assert "holds no 'Assertion ... failed' line" in text
    _lines_referred_to(text, BCE_TRACEBACK_ONLY)


def test_follow_on_errors_without_an_assertion_line_refer_to_no_missing_line() -> None:
    for log in (DEVICE_ASSERT, CUBLAS_SGEMM):
        (match,) = explain_log(log)
        assert "Assertion ... failed' line" not in match.fix.replace("holds no 'Assertion ... failed' line", "")
    with_assertion = explain_log(f"{NLL_CUDA}\n{DEVICE_ASSERT}")
    assert "An earlier 'Assertion ... failed' line in the log is the real cause" in with_assertion[1].fix
