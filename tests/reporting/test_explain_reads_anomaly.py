"""``numguard explain`` reads an anomaly-mode log as the guard reads the step (issue 35, part 2).

For each model, one real ``Trainer(detect_anomaly=True)`` fit without the guard gives the log a user has, and one
``NumGuardCallback()`` fit of the same model gives what the guard records; explain must name the user's line (the
one ending with ``# FAULT: <tag>`` in this file), never torch's, and say the guard records what it does record:

- a NaN made in a head's forward reaches ``log_softmax``: anomaly mode stops at ``LogSoftmaxBackward0`` with a
  forward traceback that ends in ``torch/nn/functional.py``; the line to change is the head's. Also when the log
  comes from another machine: library paths printed relative to ``site-packages`` (``torch/nn/functional.py``,
  as the issue quotes it), or Windows paths;
- ``(a - b).pow(2).sum(-1).sqrt()`` at ``a == b``: anomaly mode names ``PowBackward0`` (NaN is checked, Inf is
  not), the guard ``SqrtBackward0``; explain names ``SqrtBackward0`` too, and no "x ** p with p < 1" (p is 2);
- the same distance with the root on the next line: the log cannot tell which node made the Inf, and says so.
"""

from __future__ import annotations

import os
import re
import tempfile
import traceback
import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from instruments.diagnosis.real.harness import marker_line
from lightning_numguard import NumGuardCallback
from lightning_numguard.reporting.logs import Match, explain_log, format_log_report
from tests.helpers import quiet_trainer

BAD = 1  #: the global step of every fault
WIDTH, CLASSES = 6, 3


class Head(nn.Module):
    """A classifier head with a temperature that a schedule anneals to 0."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, CLASSES)
        self.temperature = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.proj(h) / self.temperature, dim=-1)  # FAULT: head


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = Head()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.head.temperature = max(0.0, 1.0 - self.global_step)  # reaches 0 at step 1
        return F.nll_loss(self.head(self.body(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Siamese(pl.LightningModule):
    """A distance between the embeddings of two views of a sample; at step ``BAD`` both views are the same."""

    def __init__(self, split_root: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.split_root = split_root

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        other = x if self.global_step == BAD else x.flip(0)
        a, b = self.embed(x), self.embed(other)
        if self.split_root:
            squared = (a - b).pow(2).sum(-1)  # FAULT: squared
            distance = squared.sqrt()  # FAULT: root
        else:
            distance = (a - b).pow(2).sum(-1).sqrt()  # FAULT: distance
        return distance.mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, WIDTH, generator=g), torch.randint(0, CLASSES, (16,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def anomaly_log(model: pl.LightningModule) -> str:
    """What a user of ``Trainer(detect_anomaly=True)`` sees on stderr: the warnings, then the traceback."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            quiet_trainer([], max_steps=BAD + 1, default_root_dir=root, detect_anomaly=True).fit(model, _data())
        except RuntimeError as err:
            said = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in records)
            return said + "".join(traceback.format_exception(err))
    raise AssertionError("anomaly mode raised nothing")


def guarded(model: pl.LightningModule) -> dict[str, Any]:
    """The root-cause event ``NumGuardCallback()`` records on the same model."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = NumGuardCallback(dirpath=os.path.join(root, "ng"))
        quiet_trainer([guard], max_steps=BAD + 1, default_root_dir=root).fit(model, _data())
    return next(e for e in guard.events if e.get("root_cause", True) and e["kind"] != "optimizer_coverage")


def anomaly_match(log: str) -> Match:
    (match,) = [m for m in explain_log(log) if m.name == "anomaly_nan_in_backward"]
    return match


# ------------------------------------------------------------------------- logs as another machine prints them

_FRAME = re.compile(r'^(\s*File ")([^"]+)(")', re.MULTILINE)


def relative_to_site_packages(log: str) -> str:
    """Every installed file as ``torch/nn/functional.py``: the path printed relative to its ``site-packages``."""
    return _FRAME.sub(lambda m: m.group(1) + re.sub(r"^.*[\\/]site-packages[\\/]", "", m.group(2)) + m.group(3), log)


def windows(log: str) -> str:
    """Every file as a Windows path (``C:\\work\\...``)."""
    return _FRAME.sub(lambda m: m.group(1) + "C:" + m.group(2).replace("/", "\\") + m.group(3), log)


def same_machine(log: str) -> str:
    return log


# ------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def classifier_log() -> str:
    return anomaly_log(Classifier())


@pytest.mark.parametrize("machine", [same_machine, relative_to_site_packages, windows])
def test_a_forward_fault_is_named_at_the_users_line_not_torchs(classifier_log: str, machine: Any) -> None:
    """Before: "forward call: torch/nn/functional.py:3494, op `log_softmax`" on a log with relative library paths."""
    log = machine(classifier_log)
    assert "functional.py" in log  # the forward traceback does end in torch's functional API
    match = anomaly_match(log)
    assert match.groups["op"] == "LogSoftmaxBackward0"
    call = match.forward
    assert call is not None
    line = marker_line(__file__, "head")
    assert (re.split(r"[\\/]", call.file)[-1], call.line, call.op) == (os.path.basename(__file__), line, "log_softmax")
    report = format_log_report([match], "train.log")
    assert "functional.py" not in report
    assert f"{call.file}:{line}" in report


def test_a_forward_fault_reads_as_the_guard_records_it(classifier_log: str) -> None:
    match = anomaly_match(classifier_log)
    event = guarded(Classifier())
    call = match.forward
    assert call is not None
    assert (match.guard_kind, f"{call.file}:{call.line}") == (event["kind"], event["source"])
    assert event["op"] == "div"  # the op that made it: upstream of log_softmax, on the line explain names
    assert "or an op upstream of it" in match.guard


def test_a_chained_backward_node_is_read_as_the_node_that_made_the_value() -> None:
    """Before: "nonfinite_grad, op PowBackward0" and "x ** p with p < 1 has an infinite gradient", p being 2."""
    match = anomaly_match(anomaly_log(Siamese()))
    assert match.groups["op"] == "PowBackward0"  # anomaly mode's node: the first NaN, after sqrt's Inf
    event = guarded(Siamese())
    call, reading = match.forward, match.reading
    assert call is not None and reading is not None
    assert reading.relayed and call.line == marker_line(__file__, "distance")
    said = (match.guard_kind, reading.maker, f"{call.file}:{call.line}")
    assert said == (event["kind"], event["op"], event["source"]) == ("nonfinite_grad", "SqrtBackward0", said[2])
    assert f"records this as nonfinite_grad, op SqrtBackward0, at {call.file}:{call.line}" in match.guard
    assert "p < 1" not in match.fix and "eps inside the root" in match.fix
    assert match.to_dict()["made_by"] == "SqrtBackward0"


def test_when_the_log_cannot_tell_which_node_made_it_it_says_so() -> None:
    """The root on the next line: the PowBackward0 line holds no call that makes an Inf."""
    match = anomaly_match(anomaly_log(Siamese(split_root=True)))
    call, reading = match.forward, match.reading
    assert match.groups["op"] == "PowBackward0" and call is not None and reading is not None
    assert call.line == marker_line(__file__, "squared")
    assert reading.relayed and reading.maker is None
    assert match.guard_kind == "nonfinite_grad" and "cannot tell" in match.guard
    assert "op PowBackward0" not in match.guard and "p < 1" not in match.fix
    event = guarded(Siamese(split_root=True))
    assert (event["kind"], event["op"]) == ("nonfinite_grad", "SqrtBackward0")
    assert event["source"] == f"{__file__}:{marker_line(__file__, 'root')}"  # a line after the one the log names
